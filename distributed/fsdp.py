"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded on dim 0.

One FSDP unit per block of each stack of the model's plan (its parameters are all-gathered
just before it runs and freed after), or per ``parallel.fsdp_unit_blocks`` consecutive blocks
of one stack (a unit never spans two stacks), plus the root unit, which holds what is left:
the embedding, final norm and output head. A tied embedding/head weight is one Parameter
that lives in the root unit only, so it is sharded, gathered and updated once and stays tied.

Precision: with ``parallel.precision=bf16`` parameters are all-gathered and computed in
bf16, gradients are reduced in fp32, and the sharded fp32 parameters are the master
weights the optimizer updates; the training loop must not also autocast (see
``is_fully_sharded``). fp32 and fp16 keep fp32 parameters here (fp16 is autocast plus
a gradient scaler in the loop).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from core.config import ParallelConfig
from distributed.expert_parallel import expert_modules
from distributed.model_structure import has_tied_embeddings, plan_of, plan_stacks


def mixed_precision_policy(parallel: ParallelConfig) -> MixedPrecisionPolicy:
    if parallel.precision == "bf16":
        reduce_dtype = torch.bfloat16 if parallel.reduce_dtype == "bf16" else torch.float32
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    return MixedPrecisionPolicy()


def offload_policy(parallel: ParallelConfig, device: torch.device) -> OffloadPolicy:
    if not parallel.cpu_offload:
        return OffloadPolicy()
    # Pinned host memory only helps (and only exists) with an accelerator to copy to.
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, parallel: ParallelConfig, device: torch.device, *,
               cast_parameters: bool = True, expert_mesh: DeviceMesh | None = None, dp_size: int = 1) -> None:
    """Shard ``model`` in place: every stack's blocks bottom-up, then the root. ``cast_parameters=False``:
    no mixed-precision policy (the parameters are gathered as stored, fp32).

    Experts split by expert parallelism (distributed/expert_parallel.py) are units of their own first,
    sharded over ``expert_mesh`` (the data-parallel ranks outside the ep group); their gradients,
    already summed over the ep group by the all-to-all's backward, are summed over ``expert_mesh``
    and divided by the whole data-parallel size ``dp_size``, as every other gradient is averaged."""
    options = dict(
        mesh=dp_mesh,
        reshard_after_forward=parallel.reshard_after_forward,
        mp_policy=mixed_precision_policy(parallel) if cast_parameters else MixedPrecisionPolicy(),
        offload_policy=offload_policy(parallel, device),
    )
    tied = has_tied_embeddings(model)
    for experts in expert_modules(model):
        if expert_mesh is None:
            raise ValueError("the model's experts are split over the ep mesh; apply_fsdp needs expert_mesh")
        fully_shard(experts, **{**options, "mesh": expert_mesh})
        experts.set_gradient_divide_factor(float(dp_size))
        # Over several ranks: a sum, then the division (gloo has no pre-multiplied sum). Over one
        # rank FSDP divides while copying the gradient and would divide again after a forced sum.
        experts.set_force_sum_reduction_for_comms(expert_mesh.size() > 1)
    units = fsdp_units(model, parallel.fsdp_unit_blocks)
    for i, unit in enumerate(units):
        # The last unit's backward starts right after the forward ends: resharding it would
        # only gather it again at once, with nothing left to overlap the gather with.
        last = i == len(units) - 1
        fully_shard(
            unit[0] if len(unit) == 1 else unit,
            **{**options, "reshard_after_forward": options["reshard_after_forward"] and not last},
        )
    # Likewise the root (embeddings, final norm, output head): the head's backward comes first.
    fully_shard(model, **{**options, "reshard_after_forward": False})
    if tied and not has_tied_embeddings(model):
        plan = plan_of(model)
        raise RuntimeError(f"FSDP untied {plan.embedding}.weight and {plan.output}.weight")


def fsdp_units(model: nn.Module, size: int) -> list[list[nn.Module]]:
    """The blocks of each FSDP unit: ``size`` consecutive blocks of one stack, stacks in the plan's order."""
    units = []
    for _, blocks in plan_stacks(model):
        blocks = list(blocks)
        units += [blocks[i : i + size] for i in range(0, len(blocks), size)]
    return units


def is_fully_sharded(model: nn.Module) -> bool:
    """True when parallelize applied FSDP (so a bf16 run is cast by FSDP, not autocast).

    With one process there is no process group and FSDP is not applied, even for
    ``strategy=fsdp``; the loop then autocasts as it would without FSDP.
    """
    return isinstance(model, FSDPModule)
