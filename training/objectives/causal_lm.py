"""``causal_lm``: next-token cross entropy over every target token (pretraining).

The loss is the sum of token losses over the labels that are not IGNORE_INDEX (the data
pipeline already masks document ends, padding and, for chat data, the tokens that carry no
loss), divided by the global batch's target count. Where the output weight is local it fuses
the output projection into the loss chunk by chunk (training/linear_cross_entropy.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from core.config import Config
from training.losses import CausalLMLoss
from training.objectives.base import TOKEN_LINES, LossOutput, ObjectiveContext, StatelessObjective
from training.objectives.causal_lm_settings import KIND
from training.step import model_loss


class CausalLMObjective(StatelessObjective):
    name = KIND.name
    capabilities = KIND.capabilities
    updates_per_batch = 1
    settles_late = True
    console = TOKEN_LINES

    def __init__(self, config: Config) -> None:
        self.loss_fn = CausalLMLoss(chunk_tokens=config.train.loss_chunk_tokens, compiled=config.parallel.compile,
                                    float8=config.parallel.float8_head)
        self._context: ObjectiveContext | None = None
        self.fuse_head = False

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None:
        self._context = context
        self.fuse_head = self.loss_fn.fuses_head and context.fuse_head

    def prepare(self, batch):
        return batch

    def num_targets(self, batch) -> int:
        return batch.num_target_tokens()

    def loss(self, model: nn.Module, micro) -> LossOutput:
        count = self.num_targets(micro)  # host labels: no device sync
        placed = micro.placed(self._context.place)
        total = model_loss(model, placed, self.loss_fn, _as_is, fuse_head=self.fuse_head)
        return LossOutput(total, count)

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        return {}



def _as_is(tensor):
    return tensor
