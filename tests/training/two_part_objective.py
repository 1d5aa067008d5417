"""A test objective that trains two parts: the policy (next-token cross entropy, as
``causal_lm``) and a small value model on its own trunk, with its own optimizer settings.

The value model (``value``) reads the same token ids through its own embedding and an MLP and
predicts, at every target position, the next token's id scaled to [0, 1] (a regression target
the batch already holds). Its squared error joins the policy's loss sum; the two modules share
no parameter, so each part's gradient comes from its own term. It exists to prove that the
loop, the checkpoint, resume and replay work over several trained parts
(tests/training/test_two_part_e2e.py); two_part_train.py is train.py with it in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import nn

from core import seeding
from core.config import Config
from data.batch import IGNORE_INDEX
from training.objectives.base import LossOutput, ObjectiveContext, PartSpec
from training.objectives.causal_lm import CausalLMObjective

VALUE_PART = "value"
VALUE_LR = 3e-3
VALUE_GRAD_CLIP = 0.5
VALUE_WIDTH = 16


class ValueModel(nn.Module):
    """ids (B, T) -> values (B, T): an embedding, one hidden layer, a scalar head."""

    def __init__(self, vocab_size: int, width: int, *, generator: torch.Generator) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        with torch.no_grad():  # from the run's seed, not the global generator
            for param in self.parameters():
                param.normal_(0.0, 0.1, generator=generator)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(ids)))  # (B, T, width)
        return self.head(h)[..., 0]  # (B, T)


class TwoPartObjective(CausalLMObjective):
    name = "two_part"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._config = config

    def extra_parts(self, context: ObjectiveContext) -> dict[str, PartSpec]:
        config = self._config
        module = ValueModel(config.model.vocab_size, VALUE_WIDTH,
                            generator=seeding.generator(config.train.seed, "value_init"))
        # Its own learning rate, schedule and clipping: constant, no warmup, a tighter clip.
        settings = dataclasses.replace(config.train, lr=VALUE_LR, schedule="constant", warmup_steps=0,
                                       weight_decay=0.0, grad_clip=VALUE_GRAD_CLIP)
        return {VALUE_PART: PartSpec(module=module, train=settings)}

    def loss(self, model: nn.Module, micro, parts: Mapping[str, nn.Module]) -> LossOutput:
        policy = super().loss(model, micro)
        placed = micro.placed(self._context.place)
        keep = (placed.labels != IGNORE_INDEX).float()  # (B, T)
        target = placed.labels.clamp(min=0).float() / self._config.model.vocab_size
        values = parts[VALUE_PART](placed.input_ids).float()  # (B, T)
        value_sum = ((values - target) ** 2 * keep).sum()
        return LossOutput(policy.sum + value_sum, policy.count, {"value_loss": value_sum.detach()})

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        return {"value_loss": totals["value_loss"] / max(count, 1)}
