"""The embedded image prompts: ``image_prompt`` records about the pinned photographs, for GRPO on the
tiny vision-language models (configs/tiny-vl-grpo.yaml).

``python -m data prepare`` writes them beside the photographs and the image chats
(data/vision/chat_data.py): ``datasets/images/prompts/{train,eval}/part-*.jsonl``, records
``{"prompt": "<image>Name the subject.", "answer": "Cat", "images": ["../../photographs/chelsea.png"]}``
(data/kinds/image_prompt.py) whose answer is the one word that names what the photograph shows:
the image chats' one-word questions, so a model fine-tuned on those answers in the form a rule
(``exact_answer``) checks. Drawn from a seeded generator: the same spec writes the same bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

from data.vision.chat_data import SUBJECTS, write_splits
from data.vision.photographs import PHOTOGRAPHS

PROMPTS_DIR = Path("datasets/images/prompts")
PROMPTS_SPEC = {"seed": 1, "train_n": 64, "eval_n": 16, "photographs": "../../photographs", "answers": "as_chats"}
"""What the prompt files are written from (their ``.complete`` stamp holds it). ``answers``: the word is
written as the image chats' answers write it (capitalized, as a sentence starts), which the
case-sensitive ``exact_answer`` compares; the lower-case words of before no model trained on the
chats could ever match (tiny-vl-grpo's reward stayed 0 on three seeds)."""
QUESTIONS = ("<image>Name the subject.", "<image>Describe the image in one word.")
"""The image chats' questions whose answer is one word (data/vision/chat_data.py ``ONE_IMAGE``)."""


def image_prompts(n: int, seed: int, photographs: str) -> list[dict]:
    """``n`` image_prompt records, one photograph each; image paths under ``photographs``."""
    rng = random.Random(seed)
    names = sorted(SUBJECTS)
    out = []
    for _ in range(n):
        name = rng.choice(names)
        word = SUBJECTS[name][1]
        out.append({"prompt": rng.choice(QUESTIONS), "answer": word[0].upper() + word[1:],
                    "images": [f"{photographs}/{PHOTOGRAPHS[name].file}"]})
    return out


def write_prompts(out: Path = PROMPTS_DIR, *, force: bool = False) -> bool:
    """Write the train and eval prompts under ``out``; False when its stamp says they are there."""
    return write_splits(out, PROMPTS_SPEC, image_prompts, force=force)
