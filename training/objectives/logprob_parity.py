"""``logprob_parity``: the sampler's log-probs of the sampled tokens against the trainer's.

GRPO and PPO sample their completions with the Sampler and train on them with the training forward.
``logprob_parity`` is max |sampler log-prob - trainer log-prob| over a micro-batch's sampled tokens,
a maximum the loop reduces over micro-batches and ranks (``LossOutput.maxima``). With the stock kernels
it is a statistic (about 1e-7 in fp32 on the CPU). Under ``determinism.batch_invariant`` the two sides
run the same kernels and must agree bit for bit (docs/determinism.md, "Sampler == trainer, bit for
bit"), so a difference there is a determinism violation: ``check_exact`` raises ``LogprobParityError``
(exit 5) naming the step, the completion's global row, the token's position and both log-probs.

The check holds where the trainer runs the weights that sampled, the first update of a step. The
method's ``prepare`` puts the sampler's log-probs a second time under ``CHECKED`` (``checked_extras``)
and its ``update_batch`` drops them from the later updates' rows (``first_update_only``): the loss
checks the rows that carry them, and only those.
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
    """The extras a rollout batch carries for ``check_exact``: the sampler's log-probs under ``CHECKED``
    where ``exact`` (``determinism.batch_invariant``), none otherwise (its rows and hash unchanged)."""
    return {CHECKED: sampled} if exact else {}


def first_update_only(batch, update: int):
    """``batch`` as update ``update`` trains on it: without ``CHECKED`` after the first update, whose
    weights no longer are the ones that sampled. The batch itself where nothing changes."""
    if update == 0 or CHECKED not in batch.extras:
        return batch
    return dataclasses.replace(batch, extras={k: v for k, v in batch.extras.items() if k != CHECKED})


def check_exact(trainer: torch.Tensor, micro) -> None:
    """Raise ``LogprobParityError`` where a labelled token's ``trainer`` log-prob (B, T) is not bitwise the
    sampler's of the placed micro-batch ``micro`` (its ``CHECKED`` extra); nothing where it has none. Reads
    one flag back from the device (a sync per micro-batch, in batch-invariant runs only)."""
    sampled = micro.extras.get(CHECKED)
    if sampled is None:
        return
    trainer = trainer.detach().float()
    differs = (micro.labels != IGNORE_INDEX) & (trainer != sampled)  # NaN differs too
    if not bool(differs.any()):
        return
    where = differs.nonzero()
    row, position = (int(i) for i in where[0])
    ours, theirs = float(trainer[row, position]), float(sampled[row, position])
    raise LogprobParityError(
        f"under determinism.batch_invariant the trainer's log-prob of a sampled token is {ours!r}, the "
        f"sampler's {theirs!r} ({len(where)} of {int((micro.labels != IGNORE_INDEX).sum())} sampled tokens of this "
        "micro-batch differ)",
        step=micro.step, row=micro.sequence_index[row], position=position,
        token=int(micro.labels[row, position]),
        hint="a kernel outside models/batch_invariant.py ran in the trainer's or the sampler's forward "
             "(docs/determinism.md, 'Sampler == trainer, bit for bit'); to train on, turn "
             "determinism.batch_invariant off (logprob_parity is then a statistic)")
