"""The objective seam: what a training method plugs into the one training loop.

The loop (training/loop.py) owns everything every method shares: data, the accumulation
over micro-batches, gradient clipping, the non-finite guard, the update, the ledger,
checkpoints, resume and replay. An ``Objective`` owns what differs between methods:

1. ``setup(context)``: build what the method needs besides the trained model (a frozen
   reference or teacher model, a sampler), once, before the first step or restore.
2. ``prepare(batch)``: per global batch, without gradients, compute what the loss needs
   beyond the batch (reference log-probs, teacher outputs, rollouts) and return the batch
   with those as ``Batch.extras``; they then travel to the device with the batch and enter
   its hash. What the ledger fields need beyond per-row tensors goes in ``Batch.prepared``
   (GRPO's rollout experience). The loop's evaluation hands held-out batches marked
   ``Batch.evaluation``; ``prepare`` and ``loss`` read the mark, never ``model.training``.
3. ``num_targets(batch)``: how many units the loss of this rank's batch averages over
   (tokens, pairs, sequences). The loop sums it over ranks; the step divides every
   micro-batch's loss sum by that global count, so accumulation and world size do not
   change the math.
4. ``loss(model, micro)``: the loss over one micro-batch as ``LossOutput(sum, count,
   metrics, maxima)``: the *sum* of per-unit losses, its count, and metric sums, all summed over
   micro-batches and ranks by the loop, and maxima, which the loop reduces by max. The loop runs steps 4's micro-batches, backward and
   one optimizer update ``updates_per_batch`` times on the same prepared batch (1 for every
   method but GRPO with ``inner_updates`` and PPO with its epochs and minibatches); a
   ``MinibatchObjective`` chooses the rows each update sees (``update_batch``), and the loop
   divides that update's loss by the global count of those rows' targets.
5. ``ledger_fields(batch, totals, count)``: the method's extra ledger fields from the prepared
   batch and the first update's metric sums and maxima (``totals``, by name) and their global
   count (the first update's rows', the whole batch's unless ``update_batch`` chose a share).
   ``console`` declares what the console shows of them (experiments/console.py): the unit the
   loss is averaged over on the step and eval lines (tokens, pairs, completions, prompts), the
   loss's label, and fields (per-unit means of the metric sums, ``objective/<name>``, or
   numeric ledger fields); the loop never asks which method it runs.
6. ``state_dict()`` / ``load_state_dict()``: the method's own checkpointable state (a JSON
   part of the checkpoint, ``objective_state.json``), plus ``frozen_identity()``: the path and
   sha256 of every frozen model, recorded in the checkpoint instead of the weights and
   verified on resume.

A method that trains more than the policy (a critic, a value head) is a ``PartsObjective``:
``extra_parts(context)``, called once after ``setup``, declares each further part it trains
(``PartSpec``: a module and its own optimizer, schedule and clipping settings); the loop
builds, wraps, steps and checkpoints them (training/parts.py) and hands the trained modules,
by name, to every ``loss(model, micro, parts)`` call. An objective without ``extra_parts``
trains the policy alone and its ``loss`` is called as ``loss(model, micro)``.

docs/architecture.md walks through adding a method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from core.config import Config, TrainConfig
from core.distributed_context import DistributedContext
from core.exceptions import CheckpointError
from core.objective_kinds import ObjectiveCapabilities
from experiments.console import ConsoleLines

OBJECTIVE_STATE_VERSION = 1


@dataclass
class LossOutput:
    """One micro-batch's loss: a sum over ``count`` units, and metric sums (fp32 tensors)."""

    sum: torch.Tensor
    count: int
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    """Values the loop reduces by max over micro-batches and ranks, not by sum (GRPO's log-prob
    parity); like the metric sums, the first update's reach ``ledger_fields``."""


@dataclass
class ObjectiveContext:
    """What an objective may use to build its parts and compute its loss."""

    config: Config
    dist: DistributedContext
    parallel: Any  # training.plan.ParallelPlan
    place: Callable[[torch.Tensor], torch.Tensor]
    """Moves a host tensor of the batch to the step's device (``ParallelPlan.place_batch``)."""
    fuse_head: bool = False
    """The output projection may be fused into the loss (``CausalLMLoss.head_loss``)."""
    run_dir: Optional[Path] = None
    """The run's directory, where a method keeps per-step records beside the ledger (GRPO's
    episodes); None where there is none (a test, a benchmark)."""
    records: bool = True
    """False in a replay: the run is only read, never written."""
    faults: Any = None
    """The rank's ``runtime.faults`` (runtime.faults.FaultInjector) where the loop runs the method: the
    faults a method's own computation fires (``logprob_drift``); None in a test or a benchmark."""


class Objective(Protocol):
    """A training method (see the module docstring for the call order)."""

    name: str
    capabilities: ObjectiveCapabilities
    """What the method declares about itself (core.objective_kinds.ObjectiveCapabilities), the same object
    its settings module registers: the loop asks these, never the method's name."""
    updates_per_batch: int
    """Optimizer updates the loop makes on one prepared batch (1 but for GRPO's inner_updates)."""
    settles_late: bool
    """Whether a step's ``ledger_fields`` may be asked for after the next step's ``prepare``
    (``runtime.deferred_settle``); false where deferring gains nothing (GRPO: its rollouts wait
    for the GPU anyway)."""
    console: ConsoleLines
    """The step and eval lines' unit, loss label and fields (module docstring, item 5)."""

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None: ...

    def prepare(self, batch) -> Any: ...

    def num_targets(self, batch) -> int: ...

    def loss(self, model: nn.Module, micro) -> LossOutput: ...

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def frozen_identity(self) -> dict[str, dict[str, str]]: ...


@dataclass(frozen=True)
class PartSpec:
    """A part an objective trains beside the policy (see the module docstring)."""

    module: nn.Module
    """The plain module, on the host, its initialization a function of the run's seed (e.g. from
    ``core.seeding.generator(seed, purpose)``); the loop places it on the step's device and
    replicates it over the data-parallel ranks (``ParallelPlan.wrap_part``)."""
    train: TrainConfig
    """Its optimizer (``optimizer``, ``lr``, betas, ``weight_decay``, ...), learning-rate
    schedule (``schedule``, ``warmup_steps``, ``min_lr_ratio``, ...) and ``grad_clip``: the run's
    ``train`` section with the part's own values (``dataclasses.replace(config.train, ...)``)."""


@runtime_checkable
class PartsObjective(Protocol):
    """An objective that trains further parts beside the policy (module docstring)."""

    def extra_parts(self, context: ObjectiveContext) -> dict[str, PartSpec]: ...

    def loss(self, model: nn.Module, micro, parts: Mapping[str, nn.Module]) -> LossOutput: ...


def declared_parts(objective: Objective, context: ObjectiveContext) -> dict[str, PartSpec]:
    """The parts ``objective`` trains beside the policy, by name: none unless it is a
    ``PartsObjective``."""
    return objective.extra_parts(context) if isinstance(objective, PartsObjective) else {}


@runtime_checkable
class MinibatchObjective(Protocol):
    """An objective whose updates of one step each see a share of the prepared batch (PPO's
    minibatches): ``update_batch(batch, update)`` returns the rows update ``update`` (0-based, of
    ``updates_per_batch``) trains on, this rank's share of them. Every rank must return at least
    one row (the data-parallel gradient sync needs every rank's backward): a rank holding none of
    an update's rows returns a row without labels, which adds nothing to the loss or its count."""

    def update_batch(self, batch, update: int) -> Any: ...


def update_batch(objective: Objective, batch, update: int):
    """The rows update ``update`` of a step trains on: the whole prepared batch unless the objective
    is a ``MinibatchObjective``."""
    return objective.update_batch(batch, update) if isinstance(objective, MinibatchObjective) else batch


TOKEN_LINES = ConsoleLines()  # loss per token, no fields: pretraining


def metric(name: str) -> str:
    """The console name of the per-unit mean of the metric sum ``name`` (``LossOutput.metrics``)."""
    return f"objective/{name}"


class StatelessObjective:
    """The checkpoint side of an objective that carries nothing from one step to the next (its
    prompts or pairs come from the data state, its randomness from the step): its state is its
    name and ``OBJECTIVE_STATE_VERSION``, and a state of another method or version is refused.
    It records no frozen model unless it overrides ``frozen_identity``."""

    name: str

    def state_dict(self) -> dict[str, Any]:
        return {"objective": self.name, "version": OBJECTIVE_STATE_VERSION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self.name, state)

    def frozen_identity(self) -> dict[str, dict[str, str]]:
        return {}


def check_state(name: str, state: dict[str, Any]) -> None:
    """Refuse an objective state written by another method or version (CheckpointError)."""
    if state.get("objective") != name or state.get("version") != OBJECTIVE_STATE_VERSION:
        raise CheckpointError(
            f"the checkpoint's objective state is for {state.get('objective')!r} "
            f"(version {state.get('version')}), this run trains {name!r} (version {OBJECTIVE_STATE_VERSION})",
            hint="resume with the run's objective.kind",
        )
