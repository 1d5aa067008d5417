"""The trainable parts of a run: named modules, each with its own optimizer, learning-rate
schedule and gradient clipping.

Every run trains the ``policy`` (the model ``model.*`` describes, under the run's ``train``
settings). An objective may declare more parts it trains beside it
(``training.objectives.base.PartSpec``: a module and its own ``train`` settings, e.g. a value
head with its own learning rate); the loop builds each one here, steps them together (one
non-finite decision for all) and the checkpoint stores each as its own part
(``training.checkpoint.manager.part_keys``). Frozen models are not parts: they are recorded by
path and sha256 (``Objective.frozen_identity``).

What a step does with the parts, in this order: every part's gradients are unscaled, then
clipped (the policy's first), then every optimizer steps, then every part's gradients are
cleared; the policy's is the step's ``grad_norm``, another part's its ``grad_norm_<name>``
ledger field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from core.config import TrainConfig
from training.checkpoint.manager import POLICY_PART
from training.optimizers.build import build_optimizer, set_lr
from training.optimizers.schedule import lr_at

POLICY = POLICY_PART
_PART_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass
class TrainablePart:
    """One trained module: its optimizer (over its parameter groups, ``training.optimizers.build``), its
    learning-rate schedule and its gradient clipping, all from ``settings``."""

    name: str
    module: nn.Module
    """The module as trained: wrapped for the data-parallel ranks where they exist."""
    optimizer: torch.optim.Optimizer
    settings: TrainConfig
    """The part's ``train`` settings: optimizer, ``lr`` and schedule keys, ``grad_clip``."""

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.settings)

    def set_lr(self, step: int) -> float:
        """Set this step's learning rate on the optimizer; returns it."""
        lr = self.lr_at(step)
        set_lr(self.optimizer, lr)
        return lr

    @property
    def grad_clip(self) -> float:
        return self.settings.grad_clip


def build_parts(policy: nn.Module, settings: TrainConfig, extra: Mapping, *, device: torch.device,
                wrap: Callable[[nn.Module], nn.Module]) -> dict[str, TrainablePart]:
    """The run's parts: the policy (already built and parallelized) under ``settings``, then
    each of ``extra`` (``{name: PartSpec}``, an objective's), placed and wrapped by ``wrap``
    (``ParallelPlan.wrap_part``), in the order the objective declared them."""
    parts = {POLICY: TrainablePart(POLICY, policy, build_optimizer(policy, settings, device), settings)}
    for name, spec in extra.items():
        if name == POLICY or not _PART_NAME.fullmatch(name):
            raise ValueError(f"the objective declares a trained part named {name!r}: part names are "
                             f"lower-case identifiers other than {POLICY!r} (Objective.extra_parts)")
        module = wrap(spec.module)
        parts[name] = TrainablePart(name, module, build_optimizer(module, spec.train, device), spec.train)
    return parts


def grad_norm_field(name: str) -> str:
    """The ledger field of a part's gradient norm (the policy's is ``grad_norm``)."""
    return f"grad_norm_{name}"


def param_hash_field(name: str) -> str:
    """The ledger field of a part's parameter hash (the policy's is ``param_hash``)."""
    return f"param_hash_{name}"
