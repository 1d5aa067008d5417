"""The image_prompt record kind (data/kinds/image_prompt.py) and its images' way into rollouts: a
prompt record with images encodes as a prompt (answer marked) with an image chat's pads and media; a
pipeline batch of such rows gives each task its images (training/rollout/environment.py), the
Generator samples with them what the trainer's forward over the batch GRPO trains on predicts
(``Experience.batch`` carries each prompt's images on its group's rows), and a text row keeps no media.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import load
from core.config_sections import DataConfig, SourceConfig
from data.chat_template import RecordError
from data.kinds.image_chat import GRIDS, IMAGE_PAD, PIXELS
from data.pipeline import build
from data.tokenizers import build_tokenizer
from models.forward import model_forward
from models.generation.sampler import SamplingParams
from training.rollout.environment import batch_tasks
from training.rollout.experience import Experience, Trajectory
from training.rollout.generator import Generator
from tests.data.image_cases import SMALL, encoder_of, write_images_root


@pytest.fixture(scope="module")
def images_root(tmp_path_factory) -> Path:
    """The photographs and the tokenizer with the vision tokens, as `python -m data prepare` writes them."""
    pytest.importorskip("skimage", reason="pip install scikit-image (requirements-dev.txt)")
    root = write_images_root(tmp_path_factory.mktemp("images"), chat=False)
    (root / "records").mkdir()
    return root


def _record(prompt: str, answer: str, *images: str) -> dict:
    return {"prompt": prompt, "answer": answer, "images": [f"../photographs/{name}" for name in images]}


def _shard(root: Path, records: list[dict]) -> Path:
    path = root / "records" / "part-000.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_record_encodes_as_a_prompt_with_its_images(images_root):
    encoder = encoder_of(images_root, "image_prompt")
    shard = str(images_root / "records" / "part-000.jsonl")
    encoded = encoder.document(_record("<image>What is in the picture?", "cat", "chelsea.png"), shard)
    pad = encoder.tokenizer.encode(IMAGE_PAD)[0]
    (grid,) = encoded.fields[GRIDS.name]
    assert int((encoded.ids == pad).sum()) == int(np.prod(grid)) // 4  # the pads of its merged grid
    mask = encoded.fields["target_mask"]
    assert encoder.tokenizer.decode(encoded.ids[mask].tolist()) == "cat"  # only the answer is marked
    assert len(encoded.fields[PIXELS.name]) == 1
    with pytest.raises(RecordError, match="1 <image> placeholders but 'images' lists 2"):
        encoder.document(_record("<image>?", "cat", "chelsea.png", "rocket.jpg"), shard)
    with pytest.raises(RecordError, match="'answer'"):
        encoder.document({"prompt": "<image>?", "images": ["../photographs/chelsea.png"]}, shard)


def test_the_embedded_prompts_are_seeded_and_encode(images_root):
    from data.vision.chat_data import SUBJECTS, conversations
    from data.vision.prompt_data import image_prompts

    records = image_prompts(12, seed=1, photographs="../photographs")
    assert records == image_prompts(12, seed=1, photographs="../photographs")
    assert {r["answer"] for r in records} <= {word.capitalize() for _, word in SUBJECTS.values()}  # as the chats'
    chats = {m["content"] for r in conversations(64, seed=0, photographs="..") for m in r["messages"]}
    assert {r["answer"] for r in records} <= chats  # an answer the chats teach, to the letter
    encoder = encoder_of(images_root, "image_prompt")
    for record in records:
        encoded = encoder.document(record, str(images_root / "records" / "part-000.jsonl"))
        assert encoder.tokenizer.decode(encoded.ids[encoded.fields["target_mask"]].tolist()) == record["answer"]


def test_rollouts_sample_with_the_prompts_images(images_root):
    from models.qwen_vl.model import empty_model

    records = [_record("<image>Name the subject.", "cat", "chelsea.png"), _record("What is 2+2?", "4"),
               _record("<image><image>What do the two pictures show?", "coffee, then rocket", "coffee.png",
                       "rocket.jpg")]
    config = DataConfig(sources=(SourceConfig(path=str(_shard(images_root, records)), name="image-prompts",
                                              record="image_prompt"),),
                        tokenizer=str(images_root / "tokenizer"), seq_len=96, num_streams=1, workers=1,
                        process_pool=False, prefetch_batches=1, images=SMALL)
    with build(config, seed=0, global_batch_size=3, rank=0, world_size=1) as pipe:
        batch = next(pipe)
    tasks = batch_tasks(batch, build_tokenizer(str(images_root / "tokenizer")))
    with_images = [t.media is not None for t in tasks]
    assert sorted(with_images) == [False, True, True]
    assert all(len(t.media[PIXELS.name]) == 2 for t in tasks if t.media and "coffee" in t.answer)

    model_config = load("configs/tiny-vl-sft.yaml", ["model.num_layers=1", "model.qwen2_5_vl.depth=1",
                                                     "model.qwen2_5_vl.fullatt_block_indexes=[0]"]).model
    model = empty_model(model_config)
    model.init_weights(torch.Generator().manual_seed(0))
    generator = Generator(rows=4, max_len=128, seed=0)
    params = SamplingParams(temperature=1.0, top_k=8, max_new_tokens=6)
    group = 2
    samples = generator.generate_from(model, [t.prompt_ids for t in tasks], [t.index for t in tasks], params,
                                      purpose="test", step=0, samples=group, media=[t.media for t in tasks])
    trajectories = tuple(Trajectory(row=t.index * group + s, prompt_ids=t.prompt_ids,
                                    tokens=samples[p * group + s].tokens, logprobs=samples[p * group + s].logprobs,
                                    truncated=False, reward=0.0)
                         for p, t in enumerate(tasks) for s in range(group))
    experience = Experience(trajectories=trajectories, group_size=group).with_advantages(np.zeros(len(trajectories)))
    trained = experience.batch(batch, seq_len=128, pad_id=0, mask_truncated=False)
    for i, rows in enumerate(trained.media[GRIDS.name]):  # each completion row shows its prompt's images
        assert len(rows) == len(batch.media[GRIDS.name][i // group])
    logps = torch.log_softmax(model_forward(model, trained).logits.float(), -1)  # the trainer's forward
    for i, t in enumerate(trajectories):
        p = len(t.prompt_ids)
        at = logps[i, p - 1: p - 1 + len(t.tokens)].gather(1, torch.tensor(t.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(t.logprobs), at, rtol=0, atol=2e-5)


def test_held_out_generation_hands_each_prompts_images_to_the_generator(images_root):
    """train.eval_generate over image prompts (training/generation_eval.py): every prompt reaches the
    generator with its row's images (none for a text prompt), and the evaluation runs through them."""
    from models.qwen_vl.model import empty_model
    from training.generation_eval import GenerationEvaluation

    records = [_record("<image>Name the subject.", "cat", "chelsea.png"), _record("What is 2+2?", "4"),
               _record("<image>Describe the image in one word.", "rocket", "rocket.jpg")]
    source = _shard(images_root, records)
    config = load("configs/tiny-vl-sft.yaml", [
        "model.num_layers=1", "model.qwen2_5_vl.depth=1", "model.qwen2_5_vl.fullatt_block_indexes=[0]",
        f"data.tokenizer={images_root / 'tokenizer'}", "data.num_streams=1", "data.process_pool=false",
        "train.global_batch_size=4", "train.micro_batch_size=4", "data.images.max_pixels=3136",
        f"train.eval_generate={{source: {{path: {source.parent}, record: image_prompt}}, prompts: 3, max_new_tokens: 4}}"])
    model = empty_model(config.model)
    model.init_weights(torch.Generator().manual_seed(0))
    evaluation = GenerationEvaluation(config, rank=0, world_size=1, device=torch.device("cpu"))
    calls = []
    generate = evaluation.generator.generate

    def recorded(ids, indices, params, **kwargs):
        calls.append([None if m is None else len(m[GRIDS.name]) for m in kwargs["media"]])
        return generate(ids, indices, params, **kwargs)

    evaluation.generator.generate = recorded
    with torch.no_grad():
        sums = evaluation.evaluate(model.eval())
    assert sums["generate/prompts"] == 3
    assert calls and all(sorted(call, key=str) == [1, 1, None] for call in calls)

