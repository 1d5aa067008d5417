"""One optimizer step: forward, loss and backward over micro-batches, then the update.

The loss of every micro-batch is its *sum* of token losses divided by the number of target
tokens in the whole global batch (all ranks, all micro-batches), so gradient accumulation
and the world size do not change the math. Data-parallel wrappers average gradients over
ranks, so the backward loss is multiplied by the data-parallel size to turn their average
back into the sum we want.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from models.qwen.forward import model_forward
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Accumulate gradients over ``micro_batches`` with ``objective.loss`` (training/objectives);
    returns this rank's summed loss (fp32), summed metrics and the maxima over micro-batches
    (``LossOutput.maxima``), all on ``device``.
    ``before_forward(i)`` runs before micro-batch ``i``'s forward (LoRA dropout keys); each
    backward runs inside ``backward_context()`` (distributed/overlap.py). ``parts``: the modules
    the objective trains beside ``model`` (training/parts.py), handed to its ``loss`` by name and
    synchronized with the model, on the last micro-batch."""
    local_sum = torch.zeros((), dtype=torch.float32, device=device)
    metrics: dict[str, torch.Tensor] = {}
    maxima: dict[str, torch.Tensor] = {}
    last = len(micro_batches) - 1
    trained = [model, *(parts or {}).values()]
    for i, micro in enumerate(micro_batches):
        if before_forward is not None:
            before_forward(i)
        with contextlib.ExitStack() as sync:
            if i != last:  # gradient all-reduce only once, on the last micro-batch
                for module in trained:
                    sync.enter_context(no_sync(module))
            with _phase(timer, "forward"), precision.autocast():
                out = objective.loss(model, micro, parts) if parts else objective.loss(model, micro)
                loss_sum = out.sum
                if poison is not None:
                    loss_sum = poison(loss_sum)
            with _phase(timer, "backward"), backward_context():
                scaled = loss_sum * (dp_size / global_targets)
                precision.scale(scaled).backward()
        local_sum += loss_sum.detach()
        for name, value in out.metrics.items():
            metrics[name] = metrics[name] + value.detach().float() if name in metrics else value.detach().float()
        for name, value in out.maxima.items():
            value = value.detach().float()
            maxima[name] = torch.maximum(maxima[name], value) if name in maxima else value
    return local_sum, metrics, maxima


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
