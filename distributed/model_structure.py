"""The plan a model gives parallelize: which of its modules are blocks, projections, embedding, head.

distributed/ may not import models/ and names no module of any model family. A model
declares its structure as ``model.parallel_plan``, a value with the fields of
``ModelParallelPlan`` below (the Qwen family's: models/qwen/plan.py); tensor parallelism,
activation checkpointing, compile, FSDP, FP8 and DDP's gathered embedding gradient apply
that plan to whatever module names it holds.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn


class ModelParallelPlan(Protocol):
    """What distributed/ reads of a model's plan (paths are attribute paths)."""

    blocks: str
    """The root's nn.ModuleList of transformer blocks."""
    colwise: tuple[str, ...]
    """Per block: linears split on their output features under tensor parallelism."""
    rowwise: tuple[str, ...]
    """Per block: linears split on their input features."""
    head_projections: tuple[str, ...]
    """The colwise linears whose output features are whole heads of ``head_dim``."""
    head_norms: tuple[str, ...]
    """Per block: per-head norms (replicated weights whose gradient sums over all heads)."""
    head_dim: int
    embedding: str
    """The root's token embedding."""
    output: str
    """The root's output projection."""


def plan_of(model: nn.Module) -> ModelParallelPlan:
    """The plan ``model`` declares; a TypeError for a model that declares none."""
    plan = getattr(model, "parallel_plan", None)
    if plan is None:
        raise TypeError(
            f"{type(model).__name__} declares no parallel_plan; parallelize needs the model's plan "
            "(its blocks, projections, embedding and output head: e.g. models/qwen/plan.py)"
        )
    return plan


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of blocks (its plan's ``blocks``); per-block wrappers are written back into it."""
    name = plan_of(model).blocks
    blocks = getattr(model, name, None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}.{name} (its plan's blocks) is not an nn.ModuleList")
    return blocks


def has_tied_embeddings(model: nn.Module) -> bool:
    """Whether the output head shares the embedding's weight (one Parameter)."""
    plan = plan_of(model)
    embed, head = getattr(model, plan.embedding, None), getattr(model, plan.output, None)
    return embed is not None and head is not None and head.weight is embed.weight
