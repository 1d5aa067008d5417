"""One optimizer step: forward, loss and backward over micro-batches, then the update.

The loss of every micro-batch is its *sum* of token losses divided by the number of target
tokens in the whole global batch (all ranks, all micro-batches), so gradient accumulation
and the world size do not change the math. Data-parallel wrappers average gradients over
ranks, so the backward loss is multiplied by the data-parallel size to turn their average
back into the sum we want.

The model's auxiliary losses (``models.forward.AuxLoss``: a router's balance loss) are added to
the objective's here and nowhere else, each divided by the global count of its own unit (every
input token, every target token, every row: ``units``) the same way, and weighted; the model's
metrics and the auxiliary losses' values travel with the objective's metric sums under
``model/`` names (``model_sum_names``) and reach the ledger as ``model/<name>`` and
``model/aux/<name>`` (``model_fields``). A model that emits neither (Qwen) runs exactly the
arithmetic it always did.

A ``PooledProductLoss`` (a router's load-balancing loss: tokens per expert times router probability
per expert, each a mean over the global batch) is formed over the global batch's counts: after the
first micro-batch's forward and before its backward, the counts of the step's other micro-batches
are read by a statistics pass (``objective.loss`` once more per micro-batch, without gradients; none
with one micro-batch) and all of them summed over the data-parallel ranks (one all-reduce of
integers, ``sum_over_replicas``). Each micro-batch then backpropagates
``weight * value(global counts, its own sums, global units) * dp_size``: the shares add up to the
global loss and its gradient, whatever the micro-batch split and the world size.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX
from models.forward import (INPUT_TOKEN, ROW, TARGET_TOKEN, EmittedOutputs, PooledProductLoss, model_forward,
                            record_emitted)
from training.losses import Loss
from training.precision import Precision


def forward_backward(
    model: nn.Module,
    micro_batches: list,
    *,
    objective,
    precision: Precision,
    global_targets: int,
    dp_size: int,
    device: torch.device,
    no_sync: Callable[[nn.Module], contextlib.AbstractContextManager],
    timer=None,
    poison: Callable[[torch.Tensor], torch.Tensor] | None = None,
    before_forward: Callable[[int], None] | None = None,
    backward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    parts: Mapping[str, nn.Module] | None = None,
    units: Mapping[str, int] | None = None,
    sum_over_replicas: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Accumulate gradients over ``micro_batches`` with ``objective.loss`` (training/objectives);
    returns this rank's summed loss (fp32), summed metrics and the maxima over micro-batches
    (``LossOutput.maxima``), all on ``device``.
    ``before_forward(i)`` runs before micro-batch ``i``'s forward (LoRA dropout keys); each
    backward runs inside ``backward_context()`` (distributed/overlap.py). ``parts``: the modules
    the objective trains beside ``model`` (training/parts.py), handed to its ``loss`` by name and
    synchronized with the model, on the last micro-batch. ``units``: the global batch's count of
    each unit an auxiliary loss may average over (``global_units``), needed only where the model
    emits auxiliary losses; the model's sums join the returned metric sums (``model_sum_names``).
    ``sum_over_replicas``: an integer tensor summed exactly over the data-parallel replicas (None: one
    replica), for the counts of a ``PooledProductLoss`` (module docstring)."""
    local_sum = torch.zeros((), dtype=torch.float32, device=device)
    metrics: dict[str, torch.Tensor] = {}
    maxima: dict[str, torch.Tensor] = {}
    last = len(micro_batches) - 1
    trained = [model, *(parts or {}).values()]
    pooled: dict[str, torch.Tensor] | None = None  # each pooled loss's counts over the global batch

    def statistics(index: int, micro) -> EmittedOutputs:
        """What micro-batch ``index``'s forwards emit, run without gradients (its counts)."""
        if before_forward is not None:
            before_forward(index)  # the same dropout keys as its training forward: the same routing
        with torch.no_grad(), precision.autocast(), record_emitted(trained, without_grad=True) as seen:
            objective.loss(model, micro, parts) if parts else objective.loss(model, micro)
        return seen

    for i, micro in enumerate(micro_batches):
        if before_forward is not None:
            before_forward(i)
        with contextlib.ExitStack() as sync:
            if i != last:  # gradient all-reduce only once, on the last micro-batch
                for module in trained:
                    sync.enter_context(no_sync(module))
            with _phase(timer, "forward"), precision.autocast(), record_emitted(trained) as emitted:
                out = objective.loss(model, micro, parts) if parts else objective.loss(model, micro)
                loss_sum = out.sum
                if poison is not None:
                    loss_sum = poison(loss_sum)
            if pooled is None and has_pooled_losses(emitted):  # the first micro-batch: before any backward
                with _phase(timer, "forward"):
                    later = [statistics(j, m) for j, m in enumerate(micro_batches[i + 1:], start=i + 1)]
                    pooled = pooled_counts([emitted, *later], sum_over_replicas)
            with _phase(timer, "backward"), backward_context():
                scaled = loss_sum * (dp_size / global_targets)
                if emitted.outputs:
                    scaled = scaled + aux_loss(emitted, units, dp_size, pooled)
                precision.scale(scaled).backward()
        local_sum += loss_sum.detach()
        if emitted.outputs:
            _add_model_sums(metrics, emitted, local_units(micro), device, units, pooled)
        for name, value in out.metrics.items():
            metrics[name] = metrics[name] + value.detach().float() if name in metrics else value.detach().float()
        for name, value in out.maxima.items():
            value = value.detach().float()
            maxima[name] = torch.maximum(maxima[name], value) if name in maxima else value
    return local_sum, metrics, maxima


# ---------------------------------------------------------------------- the model's own losses and metrics

MODEL_PREFIX = "model/"
"""The ledger, console and TensorBoard name of a model metric: ``model/<name>``."""
AUX_PREFIX = "model/aux/"
"""... and of an auxiliary loss's value (weighted, per its unit): ``model/aux/<name>``."""
COUNT_SUFFIX = ":count"
"""The metric sum that carries a model sum's divisor: ``model/<name>:count``."""


def local_units(batch) -> dict[str, int]:
    """This rank's count of each unit an auxiliary loss may average over (``models.forward.NORMALIZERS``)."""
    rows, _ = batch.input_ids.shape
    return {INPUT_TOKEN: batch.input_ids.numel(), TARGET_TOKEN: int((batch.labels != IGNORE_INDEX).sum()), ROW: rows}


def aux_loss(emitted: EmittedOutputs, units: Mapping[str, int] | None, dp_size: int,
             pooled: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The backward's share of the model's auxiliary losses: each ``weight * sum * dp_size / global
    count of its unit``, as the objective's sum is scaled by ``dp_size / global targets``; a pooled
    product loss's sum is its ``pooled_share`` of the global loss."""
    if units is None:
        raise ConfigError("the model emits auxiliary losses but the step was given no global unit counts",
                          key="model.arch", hint="pass forward_backward the global batch's units (global_units)")
    total = None
    for name, aux in emitted.aux_losses():
        total_units = max(units[aux.per], 1)
        summed = pooled_share(aux, pooled[name], total_units) if isinstance(aux, PooledProductLoss) else aux.sum
        term = summed * (aux.weight * dp_size / total_units)
        total = term if total is None else total + term
    return total


def has_pooled_losses(emitted: EmittedOutputs) -> bool:
    """Whether the model emitted a loss formed over the global batch's counts (``PooledProductLoss``)."""
    return any(isinstance(aux, PooledProductLoss) for _, aux in emitted.aux_losses())


def pooled_counts(seen: Sequence[EmittedOutputs],
                  sum_over_replicas: Callable[[torch.Tensor], torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Each pooled product loss's counts summed over the forwards of ``seen`` (the step's micro-batches)
    and over the data-parallel replicas (one all-reduce of every name's counts, int64: exact)."""
    counts: dict[str, torch.Tensor] = {}
    for emitted in seen:
        for name, aux in emitted.aux_losses():
            if isinstance(aux, PooledProductLoss):
                local = aux.counts.detach().to(torch.int64)
                counts[name] = counts[name] + local if name in counts else local
    if sum_over_replicas is None:
        return counts
    names = sorted(counts)
    flat = torch.cat([counts[name].reshape(-1) for name in names])
    summed = sum_over_replicas(flat).to(flat.device)
    sizes = [counts[name].numel() for name in names]
    return {name: part.view(counts[name].shape) for name, part in zip(names, summed.split(sizes))}


def pooled_share(aux: PooledProductLoss, counts: torch.Tensor, total_units: int) -> torch.Tensor:
    """This forward's share of a pooled product loss, as an ``AuxLoss`` sum (times the global units):
    the global counts with this forward's own sums, which alone carry the gradient."""
    return aux.value(counts.to(aux.sums.device), aux.sums, total_units) * total_units


def _add_model_sums(metrics: dict[str, torch.Tensor], emitted: EmittedOutputs, units: Mapping[str, int],
                    device: torch.device, global_units: Mapping[str, int] | None = None,
                    pooled: Mapping[str, torch.Tensor] | None = None) -> None:
    """Add this micro-batch's model sums to ``metrics``: each auxiliary loss's weighted sum over its
    local count of units (a pooled product loss: its share, ``pooled_share``), each metric's sum over
    its count (``model_sum_names``).

    A host number (a count) becomes a device scalar by a fill, never by a copy from the host: on a GPU
    that copy waits for every kernel queued before it, and a Qwen3-MoE step made nine of them (the
    count of each layer's load statistics), which left the GPU idle while the host caught up."""
    def add(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().to(device=device, dtype=torch.float32).reshape(())
        else:  # rounded to fp32 as torch.as_tensor rounds it
            value = torch.full((), value, dtype=torch.float32, device=device)
        metrics[name] = metrics[name] + value if name in metrics else value

    for name, aux in emitted.aux_losses():
        if isinstance(aux, PooledProductLoss):
            summed = pooled_share(aux, pooled[name], max(global_units[aux.per], 1)).detach()
        else:
            summed = aux.sum.detach()
        add(AUX_PREFIX + name, summed.float() * aux.weight)
        add(AUX_PREFIX + name + COUNT_SUFFIX, float(units[aux.per]))
    for name, value in emitted.metrics():
        add(MODEL_PREFIX + name, value.sum.detach().float() if isinstance(value.sum, torch.Tensor) else value.sum)
        add(MODEL_PREFIX + name + COUNT_SUFFIX, value.count)


def is_model_sum(name: str) -> bool:
    """Whether a metric sum of ``forward_backward`` is the model's (not the objective's)."""
    return name.startswith(MODEL_PREFIX)


def model_fields(totals: Mapping[str, float]) -> dict[str, float]:
    """The ledger fields of the model's sums among ``totals`` (over micro-batches, ranks and, for an
    objective that records every update, updates): ``model/<name>`` = sum / count, in name order."""
    return {name: value / max(totals[name + COUNT_SUFFIX], 1e-30) for name, value in sorted(totals.items())
            if is_model_sum(name) and not name.endswith(COUNT_SUFFIX)}


def model_loss(model: nn.Module, batch, loss_fn: Loss, place, *, fuse_head: bool) -> torch.Tensor:
    """The loss sum of a (micro-)batch: from the logits, or fused with the output projection."""
    if not fuse_head:
        return loss_fn(model_forward(model, batch, place=place).logits, batch)
    return model_forward(model, batch, place=place,
                         head=lambda hidden, weight: loss_fn.head_loss(hidden, weight, batch)).head


def _phase(timer, name: str):
    return timer.phase(name) if timer is not None else contextlib.nullcontext()


class UpdateValues:
    """An enqueued update's loss, gradient norm, agreed non-finite flags and extra values,
    read back on the host once, when first asked for (``read``).

    On a GPU the copy is queued before the update; ``read`` waits for the copy, not for the
    update, and resolves the flags with the run's guard (which counts skips) exactly once.
    """

    def __init__(self, guard, *, host: torch.Tensor | None = None, ready=None, n_flags: int = 0,
                 values: tuple[bool, float, float, list[float]] | None = None) -> None:
        self._guard, self._host, self._ready, self._n_flags = guard, host, ready, n_flags
        self._values = values

    def read(self) -> tuple[bool, float, float, list[float]]:
        """``(finite, loss, grad_norm, extra)`` as host values."""
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()  # the copy, not the update
            read = self._host.tolist()
            n = self._n_flags
            self._values = (self._guard.resolve(read[2:2 + n]), read[0], read[1], read[2 + n:])
            self._host = self._ready = None
        return self._values


def enqueue_update(optimizer: torch.optim.Optimizer, precision: Precision, guard, loss: torch.Tensor,
                   grad_norm: torch.Tensor, *, extra: torch.Tensor | None = None,
                   parts: Sequence[tuple[torch.optim.Optimizer, torch.Tensor]] = ()) -> UpdateValues:
    """Step the optimizer unless a rank's loss or gradient norm is not finite.

    Returns the update's ``UpdateValues``: ``(finite, loss, grad_norm, extra)`` as host values
    (``extra``: the values of the optional 1-D ``extra`` tensor, e.g. the objective's metric
    sums, read in the same copy); ``guard`` is the run's ``NonFiniteGuard`` (it agrees across
    ranks and counts skips).

    With a fused optimizer and no gradient scaler (bf16 and fp32 on CUDA), the decision
    stays on the device: the agreed flags set ``optimizer.found_inf``, whose fused kernel then
    leaves parameters, moments and step counts untouched, so the update is enqueued right
    behind the backward, and the host reads loss, norm and flags in one copy whenever it asks
    (the loop asks during the next step, docs/architecture.md). A run without the
    ``found_inf`` path reads the flags first and steps only if all are finite. Both give
    bit-identical results (tests/training/test_update.py).

    ``parts``: the optimizers and gradient norms of the parts trained beside ``optimizer``'s
    (training/parts.py). One decision covers all of them: a non-finite norm of any part skips
    every part's update. Their norms are read back after ``extra``'s values, in ``parts`` order.
    """
    optimizers = [optimizer, *(o for o, _ in parts)]
    checked = grad_norm  # what the guard sees: every part's norm
    if parts:
        norms = torch.stack([n.detach().reshape(()).float().to(grad_norm.device) for _, n in parts])
        checked = torch.cat([grad_norm.detach().reshape(1).float(), norms])
        extra = norms if extra is None else torch.cat([extra.detach().reshape(-1).float(), norms.to(extra.device)])
    if precision.scaler is None and all(group.get("fused") for o in optimizers for group in o.param_groups):
        flags = guard.flags(loss, checked)
        for o in optimizers:
            o.found_inf = (flags.sum() > 0).to(torch.float32)
        read = [loss.detach().reshape(1).float().to(flags.device),
                grad_norm.detach().reshape(1).float().to(flags.device), flags]
        if extra is not None:
            read.append(extra.detach().reshape(-1).float().to(flags.device))
        values = torch.cat(read)
        host = values.to("cpu", non_blocking=True)  # pinned when it comes from a GPU
        ready = torch.cuda.Event() if values.is_cuda else None
        if ready is not None:
            ready.record()
        precision.step(*optimizers)
        return UpdateValues(guard, host=host, ready=ready, n_flags=flags.numel())
    finite = guard.check(loss, checked)
    if finite:
        precision.step(*optimizers)
    extra_values = [] if extra is None else extra.detach().float().cpu().tolist()
    return UpdateValues(guard, values=(finite, float(loss), float(grad_norm), extra_values))
