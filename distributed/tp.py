"""Tensor parallelism (Megatron-style) for attention and MLP inside each block.

The model's plan (``model.parallel_plan``, core/model_plan.py) names, per block of each of
its stacks, the linears split *colwise* (output features, i.e. whole heads / MLP channels, split across
TP ranks; input replicated) and *rowwise* (input features split; outputs summed by one
all-reduce), so each sub-layer costs one all-reduce forward and one backward.

Modules return plain local tensors, so the attention sees ``heads / tp`` heads: the model
must derive its local head counts from the projection output size (``view(B, T, -1, D)``),
not from stored totals. Embedding, norms and the output head stay replicated (keeps a tied
embedding/head pair trivially tied).

Per-head norms (a stack's ``head_norms``, e.g. Qwen3's q/k RMSNorms) act per head, so each TP
rank normalises its own heads with the same replicated weight, and that weight's gradient is
a *sum over all heads*: each rank holds only its part. Making the weight a replicated DTensor
and the input a sharded one (as sequence parallelism does for the block norms) lets DTensor
all-reduce that gradient. The local tensors hold different heads; any dimension other than
the normalised last one may be declared the sharded one without changing the math, and dim 0
(batch) exists in every layout the model may use, so that is the one declared.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from core.exceptions import ConfigError
from core.model_plan import Stack
from distributed.model_structure import plan_blocks, submodule

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def block_plan(block: nn.Module, stack: Stack) -> dict[str, object]:
    """The parallelize_module plan of one block (paths relative to the block) from its stack's plan.

    A projection wrapped by another module (a LoRA adapter, models/lora.py) is sharded
    through its parts: the wrapper's ``tp_plan(style)`` maps each part's relative path to
    the style it takes; parts it does not name stay replicated.
    """
    styles = {**{path: "colwise" for path in stack.colwise}, **{path: "rowwise" for path in stack.rowwise}}
    parts: dict[str, object] = {}
    for path, style in styles.items():
        module = block.get_submodule(path)
        if hasattr(module, "tp_plan"):
            parts.update({f"{path}.{part}": STYLES[s]() for part, s in module.tp_plan(style).items()})
        else:
            parts[path] = STYLES[style]()
    for path in stack.head_norms:
        norm = submodule(block, path)
        if norm is not None and any(True for _ in norm.parameters()):
            parts[path] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return parts


def check_divisible(model: nn.Module, tp: int) -> None:
    """ConfigError naming the first projection whose heads / channels do not split by tp."""
    for stack, index, block in plan_blocks(model):
        for path in stack.colwise:
            linear = _linear(block, f"{stack.path}.{index}", path)
            units, what = linear.out_features, "output features"
            if path in stack.head_projections:
                units, what = linear.out_features // stack.head_dim, f"heads (head_dim {stack.head_dim})"
            if units % tp:
                raise ConfigError(
                    f"{stack.path}.{index}.{path} has {units} {what}, not divisible by parallel.tp={tp}",
                    key="parallel.tp",
                    hint="choose a tp degree that divides the number of key/value heads",
                )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the projections of every block of every stack over ``tp_mesh`` in place."""
    check_divisible(model, tp_mesh.size())
    for stack, _, block in plan_blocks(model):
        frozen = {name for name, param in block.named_parameters() if not param.requires_grad}
        parallelize_module(block, tp_mesh, block_plan(block, stack))
        # SequenceParallel re-creates the parameters it replicates as trainable ones: a frozen
        # parameter (a LoRA run's q/k norms) would otherwise get gradients and updates.
        for name, param in block.named_parameters():
            if name in frozen:
                param.requires_grad_(False)


def _linear(block: nn.Module, where: str, path: str) -> nn.Module:
    """The projection at ``path``: an nn.Linear or a wrapper of one (in_features, out_features)."""
    module = block.get_submodule(path)
    if not isinstance(module, nn.Linear) and not (
        hasattr(module, "in_features") and hasattr(module, "out_features")
    ):
        raise TypeError(f"{where}.{path} is {type(module).__name__}, expected a linear layer")
    return module

