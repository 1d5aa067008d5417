"""``logprob_parity``: the sampler's log-probs of the sampled tokens against the trainer's.

GRPO and PPO sample their completions with the Sampler and train on them with the training forward.
``logprob_parity`` is max |sampler log-prob - trainer log-prob| over a micro-batch's sampled tokens,
a maximum the loop reduces over micro-batches and ranks (``LossOutput.maxima``). With the stock kernels
it is a statistic (about 1e-7 in fp32 on the CPU). Under ``determinism.batch_invariant`` the two sides
run the same kernels and must agree bit for bit (docs/determinism.md, "Sampler == trainer, bit for
bit"), so a difference there is a determinism violation: ``ParityCheck`` raises ``LogprobParityError``
(exit 5) naming the step, the completion's global row, the token's position and both log-probs.

The check holds where the trainer runs the weights that sampled, the first update of a step. The
method's ``prepare`` puts the sampler's log-probs a second time under ``CHECKED`` (``checked_extras``)
and its ``update_batch`` drops them from the later updates' rows (``first_update_only``): the loss
compares the rows that carry them, and only those.

The comparison stays on the device until the step settles (``ParityCheck.add`` in the loss,
``ParityCheck.settle`` in the ledger fields): reading a flag back per micro-batch would make the host
wait for the GPU 64 times a step in the Qwen3-0.6B GRPO recipe. Both methods settle a step at once
(``settles_late`` false), so a difference still stops the run before the step's ledger line and
before any checkpoint of its weights; every rank stops, naming the row of the rank that found it.
"""

from __future__ import annotations

import dataclasses

import torch

from core.exceptions import DeterminismError
from data.batch import IGNORE_INDEX

PARITY = "logprob_parity"
"""The maximum the loss reports (``LossOutput.maxima``) and the ledger field it becomes."""
CHECKED = "parity_logps"
"""The extra (B, T) fp32 of the first update's rows under ``determinism.batch_invariant``: the sampler's
log-probs aligned with the labels, which the trainer's must equal bit for bit."""


class LogprobParityError(DeterminismError):
    """Under ``determinism.batch_invariant``, a sampled token whose trainer log-prob is not the sampler's."""


def logprob_parity(trainer: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max |trainer - sampled| over the tokens of ``mask`` (B, T); 0 where there is none."""
    return ((trainer.detach() - sampled).abs() * mask).max()


def checked_extras(sampled: torch.Tensor, *, exact: bool) -> dict[str, torch.Tensor]:
    """The extras a rollout batch carries for ``ParityCheck``: the sampler's log-probs under ``CHECKED``
    where ``exact`` (``determinism.batch_invariant``), none otherwise (its rows and hash unchanged)."""
    return {CHECKED: sampled} if exact else {}


def first_update_only(batch, update: int):
    """``batch`` as update ``update`` trains on it: without ``CHECKED`` after the first update, whose
    weights no longer are the ones that sampled. The batch itself where nothing changes."""
    if update == 0 or CHECKED not in batch.extras:
        return batch
    return dataclasses.replace(batch, extras={k: v for k, v in batch.extras.items() if k != CHECKED})


class ParityCheck:
    """The first update's exact comparison under ``determinism.batch_invariant``, kept on the device.

    ``add`` (the loss, per micro-batch) compares without reading anything back; ``settle`` (the step's
    ledger fields, on every rank at the same point) reads the step's comparisons in one copy, gathers
    each rank's first difference and raises ``LogprobParityError`` on every rank where one has any."""

    def __init__(self) -> None:
        # Per micro-batch that carries CHECKED: its step, its rows' global indices, its width, and on the
        # device (6,) float64: differing tokens, first differing flat index, trainer's and sampler's
        # log-prob and the token there, labelled tokens (float64 holds each exactly).
        self._pending: list[tuple[int, list[int], int, torch.Tensor]] = []

    def add(self, trainer: torch.Tensor, micro, faults=None) -> None:
        """Compare a labelled token's ``trainer`` log-prob (B, T) with the sampler's of the placed
        micro-batch ``micro`` (its ``CHECKED`` extra), bit for bit; nothing where it has none. ``faults``:
        the rank's fault injector, whose ``logprob_drift`` moves the first labelled token's trainer
        log-prob to the next float toward zero before the comparison (runtime/faults.py)."""
        sampled = micro.extras.get(CHECKED)
        if sampled is None or micro.labels.numel() == 0:
            return
        with torch.no_grad():
            trainer = trainer.detach().float().flatten()
            labels = micro.labels.flatten()
            labelled = labels != IGNORE_INDEX
            if faults is not None and faults.drift_logprob(micro.step):
                trainer = _drifted(trainer, labelled)
            differs = labelled & (trainer != sampled.flatten())  # NaN differs too
            first = _first(differs)
            at = [values.index_select(0, first).double() for values in (trainer, sampled.flatten(), labels)]
            record = torch.cat([differs.sum().double().view(1), first.double(), *at, labelled.sum().double().view(1)])
        self._pending.append((micro.step, list(micro.sequence_index), micro.labels.shape[-1], record))

    def settle(self, step: int, dist) -> None:
        """Raise ``LogprobParityError`` on every rank if any rank's comparisons of ``step`` found a
        difference (``dist.all_gather_object``: every rank calls this at the same point); forget them."""
        pending = [p for p in self._pending if p[0] == step]
        self._pending = [p for p in self._pending if p[0] > step]
        found = None
        if pending:
            values = torch.stack([record for *_, record in pending]).cpu().tolist()  # the GPU is done with the step
            for (_, rows, width, _), (count, first, ours, theirs, token, labelled) in zip(pending, values):
                if count:
                    row, position = divmod(int(first), width)
                    found = {"row": rows[row], "position": position, "token": int(token), "ours": ours,
                             "theirs": theirs, "count": int(count), "labelled": int(labelled)}
                    break
        parts = dist.all_gather_object(found)
        rank, found = next(((r, part) for r, part in enumerate(parts) if part is not None), (None, None))
        if found is None:
            return
        elsewhere = "" if rank == dist.rank else f"; rank {rank} found it"
        raise LogprobParityError(
            f"under determinism.batch_invariant the trainer's log-prob of a sampled token is {found['ours']!r}, the "
            f"sampler's {found['theirs']!r} ({found['count']} of {found['labelled']} sampled tokens of its "
            f"micro-batch differ{elsewhere})",
            step=step, row=found["row"], position=found["position"], token=found["token"],
            hint="a kernel outside models/batch_invariant.py ran in the trainer's or the sampler's forward "
                 "(docs/determinism.md, 'Sampler == trainer, bit for bit'); to train on, turn "
                 "determinism.batch_invariant off (logprob_parity is then a statistic)")


def _first(flags: torch.Tensor) -> torch.Tensor:
    """(1,) int64 on ``flags``' device: the index of the first set entry of ``flags`` (N,), the last index
    where none is set; computed there, nothing read back."""
    positions = torch.arange(flags.numel(), device=flags.device)
    return torch.where(flags, positions, flags.numel()).min().clamp(max=flags.numel() - 1).view(1)


def _drifted(trainer: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """``trainer`` (N,) with its first ``labelled`` entry moved to the next float toward zero (on the
    device: nothing is read back)."""
    first = _first(labelled)
    value = trainer.index_select(0, first)
    return trainer.index_copy(0, first, torch.nextafter(value, torch.zeros_like(value)))
