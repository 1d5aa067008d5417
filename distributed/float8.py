"""FP8 training of the linear layers (``parallel.float8``) through torchao's float8 training.

torchao swaps each chosen ``nn.Linear`` for a ``Float8Linear``: its forward and backward
matmuls cast their inputs to FP8 with dynamic scales (``tensorwise``: one scale per tensor;
``rowwise``: one per row, more accurate, somewhat slower) and run ``torch._scaled_mm``. The
weights stay ordinary fp32 parameters (the master weights), under the same names, so the
optimizer, checkpoints and exports do not change and a checkpoint loads with FP8 off.
With FSDP and ``tensorwise`` scaling the all-gather sends the weights in FP8 too.

FP8 all-gather scales, once per forward: to all-gather a weight in FP8, every rank must cast
its shard with the same scale, which comes from the amax of the whole weight. By default
torchao computes it inside each weight's ``fsdp_pre_all_gather``: a local amax and one small
all-reduce per weight, for every all-gather (about 200 a step for a 28-layer model, and as
many again where the backward gathers a block anew). ``precompute_scales_each_forward``
instead registers ``PrecomputeFloat8Scales`` as a forward pre-hook of the model, which does
what torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does, on the local shards: the
amaxes of all FP8 weights in one ``_foreach_norm(inf)``, one all-reduce, and the scales
stored on each weight's local shard, where ``fsdp_pre_all_gather`` uses them instead, in
the forward and in the backward's gathers alike. The numbers are the same as the per-weight path's (the amax clamped at
torchao's EPS, the division in float64, the scale in fp32; only a weight whose amax is below
EPS, 1e-12, could differ, as that clamp is done in fp32 rather than float64).

The same hook casts the shards to FP8 too, all of them in a few kernels over one flat buffer
(``precast_local_shards``), and each shard's first ``fsdp_pre_all_gather`` after it returns
that cast instead of casting through torchao's per-weight autograd function and tensor
subclass, three kernel launches and their Python a weight, issued while the GPU waits for the first
unit's all-gather (14.7 ms a step for Qwen3-1.7B on four H200s under the profiler, which
inflates such host costs; docs/performance.md, 2026-11-28g). The bytes gathered are the
same. A cast is used once, by the forward's gather (a backward that gathers a block again
casts it as torchao does, with the stored scale), and only while the weight is the one it
was cast from (the parameter's and the inner fp32 tensor's version counters,
``Float8Cast.current``).

A stored scale is stale once the weights change (optimizer step, checkpoint load, resume),
and a stale one casts the weight with a wrong scale, silently. So the hook recomputes the
scales at every forward of the model, from the weights as they are when that forward
begins: no call after the optimizer step to forget, and it holds for resume, evaluation and
gradient accumulation alike.

The hook is registered after ``fully_shard``, in front of FSDP's own root pre-forward hook:
FSDP casts each block's shards to FP8 on its all-gather streams, which wait for the current
stream once per forward, in that root hook, so scales computed before it are written before
any cast reads them. Calling a block without the model's forward skips the hook and uses the
previous forward's scales, and ``FSDPModule.set_post_optim_event`` (FSDP's streams then wait
on that event, not on the current stream) would race with it; the project does neither. With
``parallel.cpu_offload`` the hook is not registered: FSDP copies each shard to the GPU before
``fsdp_pre_all_gather``, the copy does not keep the stored scale, and torchao's per-weight
path runs anyway.

Which linears: all of the transformer blocks' projections whose two dimensions are multiples
of 16 (``torch._scaled_mm``'s requirement), never the output head (the plan's ``output``: its
logits feed the loss and are the most precision-sensitive matmul, and a large vocabulary
is rarely a multiple of 16 after sharding). ``float8_module_filter`` is that rule. The head
has its own key, ``parallel.float8_head``: the fused loss runs its matmuls in FP8 itself
(training/linear_cross_entropy.py), 2.7% more tokens/s for Qwen3-1.7B on an H200, with its
backward always precise (``require_float8_head`` checks the device; docs/performance.md,
2026-11-28f). torchao's shape rule (``_auto_filter_for_recipe``) would also keep narrow
projections such as Qwen3-1.7B's k/v (2048 -> 1024) in bf16; measured, that is 3% slower on
an H200, because they share their FP8 input with the query projection (docs/performance.md, 2026-11-28d).

Accumulation: torchao's recipes run the forward's FP8 matmul with fast accumulation and the
backward's two (input and weight gradients) with cuBLAS's more precise one;
``parallel.float8_backward_fast_accum`` gives the backward's fast accumulation too
(``backward_fast_accum``), faster and less precise (docs/parallelism.md).

Needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40, H100,
H200, B200) and torchao; ``require_float8`` says so as a ConfigError (exit 2). The
conversion cannot run on the CPU test machine; its module selection, and the FP8
all-gather under FSDP2 over gloo, are tested there with torchao's emulation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import weakref

import torch
from torch import nn

from core.config import ParallelConfig
from core.exceptions import ConfigError
from distributed.model_structure import plan_of

MIN_CAPABILITY = (8, 9)
DIM_MULTIPLE = 16


def require_float8(parallel: ParallelConfig, device: torch.device) -> None:
    """Raise a ConfigError naming ``parallel.float8`` unless FP8 training can run here."""
    if parallel.float8 == "none":
        return
    hint = "set parallel.float8=none, or run on CUDA GPUs of compute capability 8.9+ with torchao installed"
    if device.type != "cuda":
        raise ConfigError(
            f"parallel.float8={parallel.float8} needs a CUDA GPU with FP8 tensor cores; this rank runs on {device}",
            key="parallel.float8",
            hint=hint,
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"parallel.float8={parallel.float8} needs compute capability >= 8.9 (FP8 matmuls); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}",
            key="parallel.float8",
            hint=hint,
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"parallel.float8={parallel.float8} needs torchao, which is not installed ({exc})",
            key="parallel.float8",
            hint="pip install torchao (the 'float8' extra of pyproject.toml), or set parallel.float8=none",
        ) from exc


def require_float8_head(parallel: ParallelConfig, device: torch.device) -> None:
    """Raise a ConfigError naming ``parallel.float8_head`` unless ``torch._scaled_mm`` runs here:
    a CUDA GPU of compute capability 8.9+, or the CPU (emulated, for tests)."""
    if not parallel.float8_head:
        return
    hint = "leave parallel.float8_head=false, or train on CUDA GPUs of compute capability 8.9+"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(
            f"parallel.float8_head=true needs compute capability >= 8.9 (FP8 matmuls); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}",
            key="parallel.float8_head",
            hint=hint,
        )
    probe = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(probe, probe.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        raise ConfigError(
            f"parallel.float8_head=true: this torch ({torch.__version__}) cannot run FP8 matmuls on {device} ({exc})",
            key="parallel.float8_head",
            hint=hint,
        ) from exc


def float8_module_filter(module: nn.Module, fqn: str, *, output: str) -> bool:
    """True for the linears converted to FP8 (see the module docstring for the rule); ``output``
    is the path of the model's output head (its plan's ``output``)."""
    if not isinstance(module, nn.Linear) or fqn == output:
        return False
    return module.in_features % DIM_MULTIPLE == 0 and module.out_features % DIM_MULTIPLE == 0


def apply_float8(model: nn.Module, parallel: ParallelConfig, *, fsdp: bool, emulate: bool = False) -> list[str]:
    """Convert ``model``'s eligible linears in place; returns their names.

    ``fsdp``: FSDP will shard the model, so tensorwise weights are all-gathered in FP8.
    ``emulate``: torchao's CPU emulation of the FP8 matmuls (tests only).
    """
    if parallel.float8 == "none":
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(parallel.float8)
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp and gathers_in_float8(parallel), emulate=emulate)
    if parallel.float8_backward_fast_accum:
        config = dataclasses.replace(config, **backward_fast_accum())
    keep = functools.partial(float8_module_filter, output=plan_of(model).output)
    converted = [name for name, module in model.named_modules() if keep(module, name)]
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return converted


def backward_fast_accum() -> dict:
    """``Float8LinearConfig`` fields for ``parallel.float8_backward_fast_accum``: the input- and
    weight-gradient matmuls with fast accumulation, as torchao's recipes already run the
    forward's: the tensor cores keep the whole sum in their reduced-precision accumulator
    instead of moving partial sums to fp32 along the way. Bitwise repeatable either way
    (docs/performance.md, 2026-11-28b)."""
    from torchao.float8.config import Float8GemmConfig

    fast = Float8GemmConfig(use_fast_accum=True)
    return {"gemm_config_grad_input": fast, "gemm_config_grad_weight": fast}


def gathers_in_float8(parallel: ParallelConfig) -> bool:
    """FSDP all-gathers the FP8 linears' weights in FP8 (tensorwise scaling; rowwise gathers bf16)."""
    return parallel.float8 == "tensorwise"


def precompute_scales_each_forward(model: nn.Module, parallel: ParallelConfig) -> bool:
    """After ``fully_shard``: register ``PrecomputeFloat8Scales`` on ``model``, ahead of FSDP's
    root hook, where weights are all-gathered in FP8 (see the module docstring). Returns
    whether it did."""
    if not gathers_in_float8(parallel) or parallel.cpu_offload:
        return False
    from torchao.float8.float8_linear import Float8Linear

    if not any(isinstance(module, Float8Linear) for module in model.modules()):
        return False
    model.register_forward_pre_hook(PrecomputeFloat8Scales(), prepend=True)
    return True


class PrecomputeFloat8Scales:
    """Forward pre-hook of the model: the FP8 all-gather scales of all its sharded FP8 weights,
    from their current values, in one all-reduce per layout (a collective: every rank runs
    the forward; FSDP gives all the weights one layout).

    The arithmetic of torchao's ``precompute_float8_dynamic_scale_for_fsdp``, on the plain
    local shards: torchao's version runs ``_foreach_norm``, ``stack`` and ``clamp`` through
    DTensor's dispatch, which cost the host about 10 ms a step for Qwen3-1.7B's 196 FP8 weights
    (docs/performance.md), while FSDP with FP8 is bound by the host. A rank whose shard of a
    weight is empty (fewer rows than ranks) counts its amax as 0 (``shard_amax``), which the
    max over the shards ignores.

    Weights that are not sharded DTensors at that moment (a unit left unsharded by an
    evaluation forward) are skipped: they are not gathered before their next sharded forward,
    which computes their scales again.
    """

    def __init__(self) -> None:
        self._linears: list[nn.Module] | None = None  # the model's Float8Linear modules, found once

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.tensor import DTensor, Shard
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_utils import EPS
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        if self._linears is None:
            self._linears = [m for m in module.modules() if isinstance(m, Float8Linear)]
        layouts: dict[tuple, list] = {}  # the same order on every rank: the modules'
        for linear in self._linears:
            weight = linear.weight
            if isinstance(weight, DTensor) and isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor):
                layouts.setdefault((weight.device_mesh, weight.placements, weight._local_tensor._dtype), []).append(weight)
        for (mesh, placements, float8_dtype), weights in layouts.items():
            amax = shard_amax([weight._local_tensor._tensor for weight in weights])
            for dim, placement in enumerate(placements):
                if isinstance(placement, Shard):  # the max over the shards of that mesh dimension
                    amax = funcol.all_reduce(amax, "max", mesh.get_group(dim)).wait()
            # As torchao: clamp in the weights' dtype, divide in float64, keep the scale in fp32.
            scales = (torch.finfo(float8_dtype).max / torch.clamp(amax, EPS).to(torch.float64)).to(torch.float32)
            scales = scales.unbind()
            for weight, scale in zip(weights, scales):
                weight._local_tensor._precomputed_scale = scale
            precast_local_shards(weights, scales, float8_dtype)


PRECAST_CHUNK_ELEMENTS = 1 << 26  # elements cast at once: bounds the fp32 temporaries at 2 x 256 MiB


def precast_local_shards(weights: list[torch.Tensor], scales: tuple[torch.Tensor, ...] | list[torch.Tensor],
                         float8_dtype: torch.dtype) -> None:
    """Cast the local shards of many sharded FP8 weights (DTensors holding torchao's
    ``WeightWithDynamicFloat8CastTensor``) to FP8 with their all-gather ``scales``, a few
    kernels over one flat buffer for all of them, and have each shard's
    ``fsdp_pre_all_gather`` return its cast (a view of that buffer; ``_pre_all_gather_precast``).

    The arithmetic is torchao's per-weight cast (``hp_tensor_and_scale_to_float8``): the
    weight in fp32 times its scale, clamped to the FP8 range, converted, so the all-gathered
    bytes are the same; what changes is the host's work. torchao casts each weight inside
    FSDP's all-gather, three kernels through an autograd function and a tensor subclass, and
    the first FSDP unit's casts are issued while the GPU waits (docs/performance.md,
    2026-11-28g); here a chunk of weights costs a handful of kernels. Shards are scaled in
    chunks of at most ``PRECAST_CHUNK_ELEMENTS`` elements, so the fp32 temporaries stay small;
    each cast is dropped by the gather that sends it, so the FP8 copies do not outlive the
    forward's all-gathers."""
    with torch.no_grad():  # as FSDP's all-gather runs torchao's cast
        _precast(weights, scales, float8_dtype)


def _precast(weights: list[torch.Tensor], scales, float8_dtype: torch.dtype) -> None:
    max_value = torch.finfo(float8_dtype).max
    start = 0
    while start < len(weights):
        end, elements = start, 0
        while end < len(weights) and (end == start or elements + weights[end]._local_tensor.numel() <= PRECAST_CHUNK_ELEMENTS):
            elements += weights[end]._local_tensor.numel()
            end += 1
        shards = [weight._local_tensor for weight in weights[start:end]]
        numels = [shard.numel() for shard in shards]
        # One flat buffer, so the chunk costs a handful of kernels whatever its count of weights:
        # the shards in fp32, each element times its weight's scale, clamped, converted.
        flat = torch.cat([shard._tensor.reshape(-1) for shard in shards]).float()
        flat.mul_(torch.cat([scale.expand(n) for scale, n in zip(scales[start:end], numels)]))
        flat.clamp_(-max_value, max_value)
        casts = flat.to(float8_dtype).split(numels)
        for weight, shard, scale, cast in zip(weights[start:end], shards, scales[start:end], casts):
            shard._lockstep_float8_cast = Float8Cast(cast.view(shard._tensor.shape), scale, weakref.ref(weight),
                                                     weight._version, shard._tensor, shard._tensor._version)
            if "fsdp_pre_all_gather" not in shard.__dict__:
                shard.fsdp_pre_all_gather = types.MethodType(_pre_all_gather_precast, shard)
        start = end


@dataclasses.dataclass(frozen=True)
class Float8Cast:
    """A local shard's FP8 cast and what it was cast from: the sharded parameter and the fp32
    tensor inside the shard, each with its version counter at the cast. An optimizer step or a
    checkpoint load writes one of them in place (through DTensor's dispatch, the parameter's
    counter moves; stepping on the local shard, ``training/optimizers/local_shards.py``, the
    inner tensor's), which makes the cast stale."""

    data: torch.Tensor
    scale: torch.Tensor
    weight: weakref.ref
    weight_version: int
    source: torch.Tensor
    source_version: int

    def current(self, shard: torch.Tensor) -> bool:
        weight = self.weight()
        return (weight is not None and weight._version == self.weight_version and weight._local_tensor is shard
                and shard._tensor is self.source and self.source._version == self.source_version)


def _pre_all_gather_precast(self, mesh):
    """A local shard's ``fsdp_pre_all_gather`` (bound to it by ``precast_local_shards``): the
    cast made in this forward's pre-hook, as torchao's would return it, once and while it is
    current (``Float8Cast.current``); otherwise torchao's own cast (a backward that gathers
    the block again casts it anew, with the same scale, so the cast is not kept the whole step).

    FSDP calls this on its all-gather copy-in stream and copies the result on that stream; the
    cast was made on the current stream, so its memory is marked in use by the copy-in stream
    (``record_stream``) before this drops it."""
    cast = self.__dict__.pop("_lockstep_float8_cast", None)
    if cast is not None and cast.current(self):
        if cast.data.is_cuda:
            cast.data.record_stream(torch.cuda.current_stream(cast.data.device))
        return (cast.data,), (cast.scale,)
    return type(self).fsdp_pre_all_gather(self, mesh)


def shard_amax(shards: list[torch.Tensor]) -> torch.Tensor:
    """``max |x|`` of each shard, stacked; 0 for an empty shard (no inf-norm of an empty
    tensor exists, and 0 is the identity of the max over non-negative amaxes)."""
    if all(shard.numel() > 0 for shard in shards):
        return torch.stack(torch._foreach_norm(shards, ord=math.inf))
    amax = torch.zeros(len(shards), dtype=shards[0].dtype, device=shards[0].device)
    held = [i for i, shard in enumerate(shards) if shard.numel() > 0]
    if held:
        amax[held] = torch.stack(torch._foreach_norm([shards[i] for i in held], ord=math.inf))
    return amax
