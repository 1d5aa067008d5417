"""The plan a model gives parallelize, read off the model: its stacks of blocks, embedding, head.

distributed/ may not import models/ and names no module of any model family. A model
declares its structure as ``model.parallel_plan``, a ``core.model_plan.ModelParallelPlan``
(the Qwen family's: models/qwen/plan.py); tensor parallelism, activation checkpointing,
compile, FSDP, FP8 and DDP's gathered embedding gradient apply that plan to whatever module
names it holds, to every stack it lists alike.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

from core.exceptions import ConfigError
from core.model_plan import ModelParallelPlan, Stack


def plan_of(model: nn.Module) -> ModelParallelPlan:
    """The plan ``model`` declares; a TypeError for a model that declares none."""
    plan = getattr(model, "parallel_plan", None)
    if plan is None:
        raise TypeError(
            f"{type(model).__name__} declares no parallel_plan; parallelize needs the model's plan "
            "(its stacks of blocks, projections, embedding and output head: e.g. models/qwen/plan.py)"
        )
    return plan


def plan_stacks(model: nn.Module) -> list[tuple[Stack, nn.ModuleList]]:
    """Each stack of the model's plan with its nn.ModuleList, in the plan's order; per-block
    wrappers are written back into these lists."""
    stacks = []
    for stack in plan_of(model).stacks:
        blocks = submodule(model, stack.path)
        if not isinstance(blocks, nn.ModuleList):
            found = "missing" if blocks is None else type(blocks).__name__
            raise TypeError(f"{type(model).__name__}.{stack.path} (a stack of its plan) is {found}, "
                            "not an nn.ModuleList")
        stacks.append((stack, blocks))
    return stacks


def plan_blocks(model: nn.Module) -> Iterator[tuple[Stack, int, nn.Module]]:
    """``(stack, index, block)`` for every block of every stack of the model's plan."""
    for stack, blocks in plan_stacks(model):
        for index, block in enumerate(blocks):
            yield stack, index, block


def declared_plans(model: nn.Module) -> Iterator[tuple[str, ModelParallelPlan]]:
    """``(prefix, plan)`` of ``model`` and of every module inside it that declares a plan, the
    prefix being that module's name in ``model.named_modules()`` ("" for ``model`` itself,
    ``module.`` under DDP, ``trunk.`` for a critic's trunk) with a trailing dot: a path of the
    plan, prefixed, is that module's name as ``model`` reports it."""
    for name, module in model.named_modules():
        plan = getattr(module, "parallel_plan", None)
        if isinstance(plan, ModelParallelPlan):
            yield (f"{name}." if name else ""), plan


def submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at the attribute path ``path`` (dots allowed), or None where there is none."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def has_tied_embeddings(model: nn.Module) -> bool:
    """Whether the output head shares the embedding's weight (one Parameter)."""
    plan = plan_of(model)
    embed, head = submodule(model, plan.embedding), submodule(model, plan.output)
    return embed is not None and head is not None and head.weight is embed.weight


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """A ConfigError naming ``parallel.ep`` where ``ep > 1`` and the model's plan declares no
    experts, or a stack's experts do not split evenly over ``ep`` ranks."""
    if ep <= 1:
        return
    plan = plan_of(model)
    if not plan.has_experts:
        raise ConfigError(
            f"parallel.ep={ep} splits experts over ranks, but {type(model).__name__}'s parallel plan "
            "declares no experts (none of its stacks has experts)",
            key="parallel.ep",
            hint="set parallel.ep=1 for this model",
        )
    for stack in plan.stacks:
        if stack.experts is not None and stack.experts.num_experts % ep:
            raise ConfigError(
                f"parallel.ep={ep} does not divide the {stack.experts.num_experts} experts of each block of "
                f"{type(model).__name__}.{stack.path}",
                key="parallel.ep",
                hint=f"use an ep degree that divides {stack.experts.num_experts}",
            )
