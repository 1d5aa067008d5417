"""DistributedDataParallel: a full replica per data-parallel rank, gradients all-reduced.

Built over the 1-D ``dp_replicate`` mesh dimension. When tensor parallelism is on, that
mesh is a slice of the 3-D mesh and DDP prepares the TP-sharded (DTensor) parameters
itself, so DDP and TP compose. Buffers are not broadcast every forward: every rank builds
them identically (RoPE tables), and the broadcast would cost a collective per step.

``parallel.ddp_embedding_grad=gathered`` (``GatheredEmbeddingGrad``) takes a tied embedding's
lookup gradient out of DDP's reduction, so that the tied weight's bucket, the largest of a
small model with a large vocabulary, is reduced first, beside the backward, instead of last.

Parameters stored as a quantized tensor subclass (QLoRA's frozen NF4 base, models/nf4.py)
are left out of DDP altogether. DDP broadcasts rank 0's parameters when it wraps the model;
its coalesced broadcast flattens plain storages, and an NF4 weight has none of its own (its
bytes live in inner tensors), so on two ranks the broadcast scrambled the base that every
rank had quantized identically (tests/training/test_qlora_e2e.py). They are frozen, so DDP
has no gradient of theirs to reduce either.

Dynamo's DDPOptimizer is turned off (``torch._dynamo.config.optimize_ddp``). It splits every
graph compiled inside DDP's forward at gradient-bucket boundaries, so that buckets can be
reduced while the rest of a whole-model graph's backward runs. Lockstep compiles one block at
a time (distributed/compile.py), and DDP's hooks already run between the blocks' backward
graphs; the splits only cut each block into more graphs, each one more launch (and, with
``compile_mode=reduce-overhead``, one more CUDA graph), which made the 4-GPU forward
host-bound (docs/performance.md).

``parallel.ddp_overlap=false`` holds every bucket until the backward has produced the last
one, then reduces them all back to back (``AfterBackwardReduce``). Overlapped (the default),
each bucket's all-reduce starts as soon as its gradients are ready and runs beside the rest of
the backward; on a GPU busy with CUDA-graphed blocks the two compete for the SMs and NCCL's
kernels ran six times slower than alone (docs/performance.md). Deferred, the collectives have
the GPU to themselves, at the cost of the overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from core.config import ParallelConfig
from core.exceptions import ConfigError
from distributed.model_structure import plan_of, submodule
from distributed.params import is_packed


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device, parallel: ParallelConfig) -> nn.Module:
    """Wrap ``model`` (already on ``device``); returns the DDP module. ``parallel.ddp_bucket_mb``
    sizes the gradient buckets; ``parallel.reduce_dtype=bf16`` reduces them in bf16."""
    torch._dynamo.config.optimize_ddp = False  # see the module docstring
    packed = [name for name, param in model.named_parameters() if is_packed(param)]
    if packed:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, packed)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        device_mesh=dp_mesh,
        gradient_as_bucket_view=True,
        bucket_cap_mb=parallel.ddp_bucket_mb,
    )
    if not parallel.ddp_overlap:
        ddp.register_comm_hook(AfterBackwardReduce(ddp.process_group, bf16=parallel.reduce_dtype == "bf16"),
                               AfterBackwardReduce.hook)
    elif parallel.reduce_dtype == "bf16":
        ddp.register_comm_hook(ddp.process_group, bf16_reduce_hook)
    return ddp


def bf16_reduce_hook(group, bucket):  # no annotations: DDP checks them, and this module's are strings
    """All-reduce one ``dist.GradBucket`` of ``group`` in bf16 and return the bucket's future:
    each rank's gradients divided by the group size, rounded to bf16, summed, and written back
    into the bucket in its own dtype.

    The arithmetic of torch's ``bf16_compress_hook``, which DDP refuses on gloo: gloo sums bf16
    too, so the same hook runs in the CPU tests. Deterministic as the fp32 reduction is: the
    same values in the same collective give the same sum on every run."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def store(future: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(future.value()[0])
        return buffer

    return reduced.then(store)


class AfterBackwardReduce:
    """DDP communication hook state that reduces every bucket once the last one is ready.

    DDP calls the hook for buckets 0, 1, ... in order as they fill, and expects each call to
    return a future of the bucket's reduced values. For every bucket but the last, the hook
    divides it by the group size (as DDP's own reduction does) and returns its buffer in an
    already completed future: nothing reads the gradients before DDP's end of backward. The
    last bucket's call launches the all-reduces of all buckets in bucket order on the process
    group's stream and makes the current stream wait for them, so the optimizer reads reduced
    gradients. Bucket 0 opens every backward and drops whatever an earlier backward that
    failed half-way left held, so nothing stale is reduced.

    The same collectives on the same buffers as overlapped reduction, so fp32 results are
    identical to it; ``bf16=True`` applies ``bf16_reduce_hook``'s arithmetic to each bucket.
    """

    def __init__(self, group, *, bf16: bool) -> None:
        self.group = group
        self.bf16 = bf16
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
        buffer = bucket.buffer()
        size = state.group.size()
        wire = buffer.to(torch.bfloat16).div_(size) if state.bf16 else buffer.div_(size)
        if bucket.index() == 0:
            state._held.clear()
        state._held[bucket.index()] = (buffer, wire)
        if bucket.is_last():
            state._reduce_held()
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _reduce_held(self) -> None:
        held = [self._held[index] for index in sorted(self._held)]
        self._held.clear()
        works = [dist.all_reduce(wire, group=self.group, async_op=True) for _, wire in held]
        for work in works:
            work.wait()  # NCCL: the current stream waits, the host does not; gloo: the host waits
        if self.bf16:
            for buffer, wire in held:
                buffer.copy_(wire)


class GatheredEmbeddingGrad:
    """A tied embedding's lookup gradient, all-gathered as rows instead of all-reduced dense.

    With tied embeddings the weight's gradient has two parts: the output head's, ready at the
    start of the backward, and the lookup's, ready only at its very end. DDP reduces a weight
    once both have accumulated, so the tied weight's bucket (a quarter of Qwen2.5-0.5B's
    parameters) is the last one ready, and its all-reduce runs after the backward with nothing
    left to overlap it. Here the lookup takes the weight detached, so autograd never adds into
    the weight's gradient from it: DDP sees the weight ready right after the head's backward
    and reduces its bucket beside the rest of the backward. The lookup's backward keeps its
    token ids and gradient rows instead, and ``add_to_grad``, called once after the step's last
    backward (``training.plan.ParallelPlan.finish_backward``), all-gathers every rank's rows,
    divides them by the group size as DDP divides its buckets, and adds them into the reduced
    gradient. Gathering sends ``ranks x tokens x (hidden + 1)`` values, against the dense
    all-reduce's ``vocab x hidden``: 59 MB against 545 MB for Qwen2.5-0.5B at 4,096 tokens per
    GPU on four GPUs. Where the gathered rows would be as large as the dense gradient, the rows
    are summed into a dense tensor and all-reduced instead (the same values).

    Every rank sends ``max_tokens`` rows (the step's tokens per rank at most, from the config),
    padded with zero rows at token 0, so no rank needs to know another's count and the host
    never waits for the GPU. The sum differs from the dense reduction's in rounding only:
    bitwise repeatable run to run, not bitwise equal to ``dense``.
    """

    def __init__(self, embedding: nn.Embedding, group, *, max_tokens: int) -> None:
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("GatheredEmbeddingGrad needs a plain embedding (no padding_idx, max_norm or sparse)")
        self.embedding, self.group, self.max_tokens = embedding, group, max_tokens
        vocab, hidden = embedding.weight.shape
        self.gathered_bytes = 4 * group.size() * max_tokens * (hidden + 1)
        self.dense_bytes = 4 * vocab * hidden
        self.gathers = self.gathered_bytes < self.dense_bytes and vocab <= 2**24  # else: rows summed, all-reduced
        # Makes the lookup's output require grad, so its backward runs; never gets a gradient.
        self.anchor = torch.zeros((), device=embedding.weight.device, requires_grad=True)
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        embedding.__class__ = _GatheredGradEmbedding  # same parameters, names and state dict
        embedding.gathered_grad = self

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return _LookupKeepingRows.apply(ids, self.embedding.weight.detach(), self.anchor, self)

    def add_to_grad(self) -> None:
        """Add every rank's kept lookup rows into the (already reduced) weight gradient."""
        if not self._rows:
            return
        weight = self.embedding.weight
        vocab, hidden = weight.shape
        ids = torch.cat([i.reshape(-1) for i, _ in self._rows])
        rows = torch.cat([g.reshape(-1, hidden).float() for _, g in self._rows])
        self._rows.clear()
        count, world = ids.numel(), self.group.size()
        if count > self.max_tokens:
            raise ConfigError(
                f"parallel.ddp_embedding_grad=gathered: this rank looked up {count} tokens in one step, more "
                f"than the {self.max_tokens} its config allows (rows per rank x data.seq_len)",
                key="parallel.ddp_embedding_grad",
                rank=dist.get_rank(),
                hint="set parallel.ddp_embedding_grad=dense for this objective",
            )
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        if not self.gathers:
            dense = torch.zeros(vocab, hidden, dtype=torch.float32, device=weight.device)
            dense.index_put_((ids,), rows, accumulate=True)
            dist.all_reduce(dense.div_(world), group=self.group)
            weight.grad.add_(dense.to(weight.grad.dtype))
            return
        packed = rows.new_zeros(self.max_tokens, hidden + 1)  # column 0: the token id (exact in fp32)
        packed[:count, 0] = ids.float()
        packed[:count, 1:] = rows
        gathered = packed.new_empty(world * self.max_tokens, hidden + 1)
        dist.all_gather_into_tensor(gathered, packed, group=self.group)
        token = gathered[:, 0].long()
        weight.grad.index_put_((token,), gathered[:, 1:].div_(world).to(weight.grad.dtype), accumulate=True)


class _GatheredGradEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose trained lookups go through ``GatheredEmbeddingGrad``."""

    gathered_grad: GatheredEmbeddingGrad

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return self.gathered_grad.lookup(input)
        return super().forward(input)


class _LookupKeepingRows(torch.autograd.Function):
    """The embedding lookup of a detached weight; its backward keeps ``(ids, grad rows)``."""

    @staticmethod
    def forward(ctx, ids, weight, anchor, owner):
        ctx.save_for_backward(ids)
        ctx.owner = owner
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ctx.owner._rows.append((ids, grad))
        return None, None, None, None


def gather_embedding_grad(model: nn.Module, group, *, max_tokens: int) -> GatheredEmbeddingGrad | None:
    """Apply ``parallel.ddp_embedding_grad=gathered`` to a DDP-wrapped model whose output head
    shares a whole (not tensor-parallel), trained embedding weight; None where it does not
    apply (the embedding is frozen, sharded or not tied)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else None
    if inner is None:
        return None
    plan = plan_of(inner)
    embedding = submodule(inner, plan.embedding)
    head = submodule(inner, plan.output)
    if not isinstance(embedding, nn.Embedding) or head is None or head.weight is not embedding.weight:
        return None
    weight = embedding.weight
    if not weight.requires_grad or type(weight) not in (torch.Tensor, nn.Parameter):
        return None
    return GatheredEmbeddingGrad(embedding, group, max_tokens=max_tokens)
