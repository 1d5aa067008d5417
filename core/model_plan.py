"""The parallel plan a model declares: its stacks of blocks, their projections and experts, its root modules.

A model family describes how its model is spread as a ``ModelParallelPlan`` (``model.parallel_plan``,
the Qwen family's in models/qwen/plan.py). distributed/ applies it (tensor parallelism, activation
checkpointing, compile, FSDP units, FP8, DDP's gathered embedding gradient) and training/ reads the
module names it needs from it (the output head, the embedding, the final norm), so neither names a
module of any family. It lives in core, torch-free, because both models/ and distributed/ import it.

Every path is an attribute path (dots allowed, ``"vision.blocks"``): a stack's ``path`` and the root
modules relative to the model, a block's projections relative to one block of its stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.exceptions import ConfigError


@dataclass(frozen=True)
class Experts:
    """A block's mixture of experts: the module holding its experts' parameters stacked on dim 0."""

    path: str
    """Per block: the module whose parameters are stacked per expert (dim 0 indexes the expert)."""
    num_experts: int
    """How many experts each block of the stack holds (expert parallelism splits them)."""


@dataclass(frozen=True)
class Stack:
    """One nn.ModuleList of blocks that share a structure, and what tensor parallelism splits in each."""

    path: str
    """The nn.ModuleList of blocks, relative to the model (``"layers"``, ``"vision.blocks"``)."""
    colwise: tuple[str, ...] = ()
    """Per block: the linears split on their output features under tensor parallelism."""
    rowwise: tuple[str, ...] = ()
    """Per block: the linears split on their input features (outputs all-reduced)."""
    head_projections: tuple[str, ...] = ()
    """The colwise linears whose output features are whole attention heads of ``head_dim``."""
    head_norms: tuple[str, ...] = ()
    """Per block: norms applied per attention head (absent modules are skipped)."""
    head_dim: int = 0
    """Width of one attention head (tensor parallelism splits whole heads); 0 without head projections."""
    experts: Experts | None = None
    """The block's experts, where its blocks are mixtures of experts; None for dense blocks."""

    def __post_init__(self) -> None:
        where = f"parallel plan stack {self.path!r}"
        if not self.path or any(not part for part in self.path.split(".")):
            raise ConfigError(f"{where}: the path of a stack is an attribute path such as 'layers'",
                              hint="name the model's nn.ModuleList of blocks")
        stray = [p for p in self.head_projections if p not in self.colwise]
        if stray:
            raise ConfigError(f"{where}: head_projections {stray} are not colwise projections",
                              hint="list every head projection in colwise too")
        if self.head_projections and self.head_dim < 1:
            raise ConfigError(f"{where}: head_projections need head_dim >= 1, got {self.head_dim}",
                              hint="set the stack's head_dim to the width of one attention head")
        if self.experts is not None and self.experts.num_experts < 1:
            raise ConfigError(f"{where}: experts.num_experts must be >= 1, got {self.experts.num_experts}",
                              hint="set it to the number of experts in each block")


@dataclass(frozen=True)
class ModelParallelPlan:
    """A model's structure as parallelism sees it.

    ``stacks`` are listed in the order the forward runs them: FSDP keeps the last unit of the last
    stack gathered after the forward, as its backward starts at once.
    """

    stacks: tuple[Stack, ...]
    """The model's stacks of blocks; each block is one unit of FSDP, activation checkpointing and compile."""
    embedding: str
    """The model's token embedding (no weight decay; tied to ``output`` or not)."""
    output: str
    """The model's output projection (tied to the embedding or not); never converted to FP8."""
    root_modules: tuple[str, ...] = ()
    """Other modules outside the stacks that tools report on by name (the final norm); they live in FSDP's root unit."""

    def __post_init__(self) -> None:
        if not self.stacks:
            raise ConfigError("a parallel plan needs at least one stack of blocks",
                              hint="declare the model's nn.ModuleList of blocks as a Stack")
        paths = [stack.path for stack in self.stacks]
        nested = [(a, b) for a in paths for b in paths if a != b and b.startswith(a + ".")]
        if len(set(paths)) != len(paths) or nested:
            raise ConfigError(f"parallel plan stacks {paths}: each stack must be its own nn.ModuleList, "
                              "none repeated or inside another", hint="list each stack of blocks once")

    def in_blocks(self, name: str) -> bool:
        """Whether the module path ``name`` (relative to the model) lies inside a block of one of the
        stacks (``layers.3.mlp.up_proj``): where LoRA looks for linears to wrap and NF4 quantizes."""
        return any(name.startswith(f"{stack.path}.") for stack in self.stacks)

    @property
    def has_experts(self) -> bool:
        """Whether any stack's blocks hold experts (expert parallelism has something to split)."""
        return any(stack.experts is not None for stack in self.stacks)
