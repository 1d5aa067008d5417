"""The ``image_prompt`` record kind: a GRPO/PPO prompt whose user turns show images, one a row.

A record is ``{"prompt": ..., "answer": ..., "images": ["photos/cat.png", ...]}``: a ``prompt``
record (data/kinds/prompt.py: the prompt a string or messages, ``tools`` optional) with the image
chat kind's ``images`` (data/kinds/image_chat.py: each ``<image>`` of a user turn stands for the next
image, paths relative to the record's file). It is encoded as a prompt record is (the prompt
rendered with the generation prompt, then the answer's tokens, which the target mask marks), its
images as an image chat's are (decoded in the worker stage under ``data.images``, each pad repeated
once per merged patch, no vision token marked, ``pixel_values`` and ``image_grid_thw`` in
``Batch.media``). Rollouts hand each row's images to the sampler with its prompt
(training/rollout/environment.py ``Task.media``). Bad records are an image chat's or a prompt's.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from data.fields import TARGET_MASK
from data.kinds.image_chat import GRIDS, PIXELS, ImageChatDocuments
from data.kinds.prompt import prompt_parts
from data.record_kinds import Encoded, RecordKind


class ImagePromptDocuments(ImageChatDocuments):
    """An ``image_prompt`` record (and the shard it came from) -> prompt then answer ids, the answer
    marked, and its images' patches."""

    def document(self, record: Any, shard: Optional[str] = None) -> Encoded:
        messages, answer, tools = prompt_parts(record)
        images, rendered = self._shown(record, messages, shard, "prompt")
        prompt_ids = self.tokenizer.encode_array(self.template.render(rendered, add_generation_prompt=True,
                                                                      tools=tools))
        answer_ids = self.tokenizer.encode_array(answer)
        ids = np.concatenate([prompt_ids, answer_ids]).astype(np.int32)
        mask = np.concatenate([np.zeros(len(prompt_ids), dtype=bool), np.ones(len(answer_ids), dtype=bool)])
        return self._encoded(ids, mask, images)


KIND = RecordKind(name="image_prompt", summary='{"prompt", "answer", "images": [...]}: a GRPO/PPO prompt whose '
                  "user turns show images (<image>), one a row", columns=("prompt", "answer", "images"),
                  encoder=ImagePromptDocuments, uses_template=True, one_per_row=True,
                  fields=(TARGET_MASK, PIXELS, GRIDS))
