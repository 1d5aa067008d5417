"""parallelize: one pure function that turns a plain model into the configured parallel one.

The order of the steps matters, and each step says why it comes where it does.
"""

from __future__ import annotations

from torch import nn

from core.config import ParallelConfig
from core.distributed_context import DistributedContext
from distributed.activation_checkpoint import apply_activation_checkpointing
from distributed.compile import apply_compile
from distributed.ddp import apply_ddp
from distributed.expert_parallel import apply_expert_parallel
from distributed.float8 import apply_float8, precompute_scales_each_forward, require_float8, require_float8_head
from distributed.fsdp import apply_fsdp
from distributed.model_structure import check_expert_parallel
from distributed.topology import Topology
from distributed.tp import apply_tensor_parallel


def parallelize(
    model: nn.Module, parallel: ParallelConfig, dist: DistributedContext, topology: Topology, *,
    cast_parameters: bool = True,
) -> nn.Module:
    """Apply FP8, TP, EP, activation checkpointing, compile and FSDP/DDP to ``model``, in that order.

    ``model`` is the plain model with identical weights on every rank (built from the same
    seed); the blocks of every stack of its plan (``model.parallel_plan``) are modified in
    place and the returned module is what the loop trains: the model itself, or its DDP
    wrapper. Use ``distributed.params.unwrap`` to get back to the model. ``parallel.ep > 1``
    needs a plan that declares experts.

    ``cast_parameters=False`` (frozen models): FSDP gathers the fp32 parameters and leaves the
    casting to the caller's autocast, as a plain model computes, on any number of ranks.
    """
    if parallel.strategy == "xla_spmd":
        raise ValueError("parallel.strategy=xla_spmd is set up by distributed.xla_spmd.setup_xla_spmd")
    check_expert_parallel(model, topology.ep_size)
    model.to(dist.device)

    # 0. FP8 linears before anything wraps or shards them: torchao swaps nn.Linear modules
    #    in place (the same parameters), and FSDP below then all-gathers their weights in FP8.
    require_float8(parallel, dist.device)
    require_float8_head(parallel, dist.device)
    apply_float8(model, parallel, fsdp=parallel.strategy == "fsdp" and topology.mesh is not None)

    # 1. Tensor parallelism first: it needs the raw nn.Linear modules at their plain paths,
    #    and FSDP below must see the TP-sharded DTensor parameters to shard them further
    #    over the data-parallel dimension (2-D FSDP x TP).
    if topology.tp_size > 1:
        apply_tensor_parallel(model, topology.tp_mesh)

    # 1b. Expert parallelism after TP (torchtitan's order: TP -> EP -> FP8 -> AC -> FSDP2; FP8 here
    #     swaps linears only, never the stacked experts, so it may come first): the plan's experts
    #     become DTensor shards on the ep mesh, and FSDP below shards them further over the
    #     data-parallel ranks outside the ep group. Activation checkpointing then replays the
    #     block's all-to-alls in backward.
    if topology.ep_size > 1:
        apply_expert_parallel(model, topology.ep_mesh)

    # 2. Activation checkpointing wraps each (TP-sharded) block, so recomputation in
    #    backward replays the block including its TP collectives.
    apply_activation_checkpointing(model, parallel.activation_checkpointing)

    # 3. Compile each block after wrapping it, so the compiled region contains the
    #    checkpoint logic too; before FSDP/DDP, so their communication hooks stay between
    #    the compiled blocks instead of being traced into them.
    if parallel.compile:
        apply_compile(model, parallel.compile_mode)

    # 4. Data parallelism last: fully_shard registers its hooks on the final block objects
    #    (the wrappers above), and DDP must wrap the finished model to see every parameter.
    if topology.mesh is not None:
        if parallel.strategy == "fsdp":
            apply_fsdp(model, topology.dp_mesh, parallel, dist.device, cast_parameters=cast_parameters,
                       expert_mesh=topology.expert_dp_mesh, dp_size=topology.dp_size)
            # 5. FP8 all-gather scales in one all-reduce per forward, in front of the hook
            #    fully_shard just registered on the root (distributed/float8.py says why).
            if parallel.float8 != "none":
                precompute_scales_each_forward(model, parallel)
        elif parallel.strategy == "ddp" and topology.dp_size > 1:
            return apply_ddp(model, topology.dp_mesh, dist.device, parallel)
    return model
