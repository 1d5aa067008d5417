"""Continuous refill: which sample each of the sampler's cache rows decodes, and when rows change hands.

The Sampler (models/generation/sampler.py) runs every forward at ``max_batch`` rows. Without a
scheduler, samples go through in groups of max_batch and a group decodes until its longest
sample ends: with completion lengths spread 16..256, most rows idle most of the time.
``RowSlots`` keeps a queue of pending samples instead; at every refill point (every
``Sampler.refill_every`` decode steps, default 8, where the host already reads the finished
flags) the finished rows hand back their samples and take the next pending ones. Shapes
stay fixed, because a row's result may change with the number of rows in a forward:

- a prefill (a first fill or a refill) runs forwards of ``Sampler.prefill_rows`` rows, the
  prompts of the rows it fills, in fixed chunks, into a prefill cache of that many rows, and
  copies those rows into the cache: the other rows' caches are untouched, and a refill point
  costs about the rows it fills, not max_batch; with ``Sampler.prefill_ahead`` the next
  pending prompts wait prefilled in a staging pool (``StagingPool``), and a point copies
  them into its free rows;
- the decode step is the same compiled (CUDA-graphed) function of (B, 1) tokens and
  positions: every row carries its own position, local step and budget in device tensors.

A row's uniform at its local step t is ``counter_uniforms(stream, .)[t]`` of its own key, so
a sample's tokens are those it gets alone or in any group (tests/models/test_scheduler.py
compares them bitwise with the group-by-group schedule).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Optional, Sequence

import numpy as np
import torch


def upload(arrays: Sequence[np.ndarray], device: torch.device, dtype: Optional[type] = None) -> list[torch.Tensor]:
    """Host arrays -> tensors of their shapes on ``device``, in one copy queued behind the device's work.

    On CUDA the copy goes from page-locked memory, so it does not wait for the stream (a copy from
    pageable memory does). ``dtype``: the arrays' common numpy dtype (default the first's).
    """
    dtype = dtype or arrays[0].dtype
    flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=dtype).ravel() for a in arrays]))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    views, at = [], 0
    for a in arrays:
        views.append(flat[at: at + a.size].view(a.shape))
        at += a.size
    return views


class RowSlots:
    """Host bookkeeping: which sample (an index into the ``generate`` call) each cache row holds.

    Samples enter rows in call order, each at the first refill point where a row is free;
    a row is free once its sample has finished (the device's ``done`` flag) and been handed
    back. Which row, and when, changes no token of a sample.
    """

    def __init__(self, rows: int, samples: int) -> None:
        self.pending = deque(range(samples))
        self.occupant: list[int | None] = [None] * rows

    @property
    def busy(self) -> bool:
        """Whether any row still holds a sample."""
        return any(sample is not None for sample in self.occupant)

    def refill(self, finished: np.ndarray) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``finished`` (B,) bool -> (handed back, newly assigned): lists of (row, sample)."""
        handed_back = []
        for row, sample in enumerate(self.occupant):
            if sample is not None and finished[row]:
                handed_back.append((row, sample))
                self.occupant[row] = None
        assigned = []
        for row, sample in enumerate(self.occupant):
            if sample is None and self.pending:
                self.occupant[row] = self.pending.popleft()
                assigned.append((row, self.occupant[row]))
        return handed_back, assigned


class StagingPool:
    """Host bookkeeping of the staging pool: cache rows (slots) that hold the prompts of the next
    pending samples, prefilled ahead of the refill points that take them.

    Its samples are always the first ones of ``RowSlots.pending`` (the queue's order), so at a
    refill point the samples it holds are the first assigned ones. ``next_groups`` stages the
    pending samples after them in groups of ``group`` (a prefill forward's rows) while the pool
    has room for a whole group (or for all that is left). A sample is staged once and taken
    once: none is prefilled twice.
    """

    def __init__(self, slots: int, group: int) -> None:
        self.free = list(range(slots))
        self.group = group
        self.staged: dict[int, int] = {}  # sample -> its slot, in the queue's order

    def take(self, samples: Sequence[int]) -> list[int]:
        """The slots of the leading ``samples`` (a refill point's assigned ones, in order) that the pool
        holds; those slots are free again (the copy out of them is queued before anything rewrites them)."""
        slots = []
        for sample in samples:
            if sample not in self.staged:
                break
            slots.append(self.staged.pop(sample))
        assert not any(s in self.staged for s in samples[len(slots):]), "staged samples are taken in order"
        self.free.extend(slots)
        self.free.sort()
        return slots

    def next_groups(self, pending: deque) -> list[tuple[list[int], list[int]]]:
        """(samples, slots) of each group to prefill into the pool now."""
        waiting = list(itertools.islice(pending, len(self.staged), None))
        groups = []
        while waiting and len(self.free) >= min(self.group, len(waiting)):
            samples, waiting = waiting[: self.group], waiting[self.group:]
            slots, self.free = self.free[: len(samples)], self.free[len(samples):]
            self.staged.update(zip(samples, slots))
            groups.append((samples, slots))
        return groups


def done_lag(every: int) -> int:
    """The decode steps by which a refill point's done flags trail it, with a point every ``every`` steps.

    The flags are fetched one step before the point, so that the host waits for them while the
    device still runs that last step, and its work at the point (bookkeeping, queuing copies and
    prefills) hides behind it. A row whose sample stops at that last step is seen at the next
    point; one that reaches its budget there is not late (the host knows when a budget ends).
    With a point every step there is no step between, and the point waits for its own flags.
    """
    return 1 if every > 1 else 0


def decode_steps(lengths: Sequence[int], rows: int, every: int, schedule: str, budget: int) -> int:
    """The decode steps a ``Sampler`` runs for samples that generate ``lengths`` tokens each (stop
    tokens included; at most ``budget``): under "refill" with a refill point every ``every`` steps
    (seeing the rows done ``done_lag(every)`` steps before it), or under "groups" (``rows`` samples
    at a time, each group until its longest has ended, checked every ``every`` steps). The least a
    schedule can cost: a rollout's time over its steps is the cost of a step, and the two
    schedules' step counts bound the speedup refill can give. Prefilling ahead (``StagingPool``)
    changes no step: every point fills all its free rows, from the pool first.
    """
    if schedule == "groups":
        return sum(min(budget, -(-max(lengths[first: first + rows]) // every) * every)
                   for first in range(0, len(lengths), rows))
    slots = RowSlots(rows, len(lengths))
    ends = np.zeros(rows, dtype=np.int64)  # the step after each row's last token
    ends_by = np.zeros(rows, dtype=np.int64)  # the step after its budget's last token: known ahead
    lag, step = done_lag(every), 0
    while True:
        if step % every == 0:
            _, assigned = slots.refill((ends <= step - lag) | (ends_by <= step))
            for row, sample in assigned:
                ends[row], ends_by[row] = step + lengths[sample], step + budget
            if not slots.busy:
                return step
        step += 1


class RowState:
    """Device state of the B decoding rows, fixed shapes: each row at its own position and local step.

    A row decodes its sample's local step t at position ``start + t`` with uniform
    ``uniforms[row, t]`` (its own key's, counter t), writes the token into column t of its
    output, and is done after a stop token or ``budget`` tokens. A done row keeps stepping
    (static shapes) until it is refilled: its position and uniform index are clamped, its
    outputs land in the spare last column, and its cache writes go to slots it rewrites
    before reading them after a refill.

    Its tensors keep their storage for its whole life (a step is changed in place), so a CUDA
    graph of a whole decode step (``Sampler``) reads and writes them; ``reset`` frees every
    row for the next call. ``width`` is the longest budget it can hold.
    """

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)  # (B, 1) the token to feed
        self.start = torch.zeros(rows, dtype=torch.long, device=device)  # position of the last prompt token
        self.local = torch.zeros(rows, dtype=torch.long, device=device)  # tokens generated so far
        self.budget = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)  # no sample yet: free
        self.uniforms = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.out_tokens = torch.zeros(rows, width + 1, dtype=torch.long, device=device)  # + a spare column
        self.out_logprobs = torch.zeros(rows, width + 1, dtype=torch.float32, device=device)
        self._inputs, self._advance = row_inputs, row_advance

    def compile(self) -> None:
        """Run ``inputs`` and ``advance`` as compiled kernels (a few fused ones instead of a dozen)."""
        self._inputs = torch.compile(row_inputs, fullgraph=True, dynamic=False)
        self._advance = torch.compile(row_advance, fullgraph=True, dynamic=False)

    def reset(self) -> None:
        """Every row free, at position 0: the state of a new call."""
        for tensor in (self.token, self.start, self.local, self.budget):
            tensor.zero_()
        self.done.fill_(True)

    def load(self, rows: torch.Tensor, last: torch.Tensor, start: torch.Tensor, budget: torch.Tensor,
             uniforms: torch.Tensor) -> None:
        """Start samples in ``rows`` (k,) (their caches already prefilled), device tensors: each one's last
        prompt token, that token's position and its budget (k,), and its uniforms (k, n), n <= width."""
        self.token[rows, 0] = last
        self.start[rows] = start
        self.local.index_fill_(0, rows, 0)  # a fill, not a host scalar copied over (which waits for the GPU)
        self.budget[rows] = budget
        self.done.index_fill_(0, rows, False)
        self.uniforms[rows, : uniforms.shape[1]] = uniforms

    def inputs(self, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens (B, 1), positions (B, 1), uniforms (B,)) of the next decode step."""
        return (self.token, *self._inputs(self.start, self.local, self.uniforms, slots))

    def advance(self, next_token: torch.Tensor, logprob: torch.Tensor, stops: torch.Tensor) -> None:
        """Record one decode step's (B,) tokens and log-probs; ``stops`` (vocab,) bool marks the ids that end a sample."""
        self._advance(self.out_tokens, self.out_logprobs, self.token, self.local, self.done, self.budget,
                      next_token, logprob, stops)

    def outputs(self, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, log-probs), each (k, width): what ``rows`` (k,) wrote so far (cut them at the sample's end)."""
        return self.out_tokens[rows, :width], self.out_logprobs[rows, :width]


def row_inputs(start: torch.Tensor, local: torch.Tensor, uniforms: torch.Tensor,
               slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``RowState.inputs``' positions (B, 1) and uniforms (B,)."""
    positions = (start + local).clamp(max=slots - 1)[:, None]
    return positions, uniforms.gather(1, local.clamp(max=uniforms.shape[1] - 1)[:, None]).squeeze(1)


def row_advance(out_tokens: torch.Tensor, out_logprobs: torch.Tensor, token: torch.Tensor, local: torch.Tensor,
                done: torch.Tensor, budget: torch.Tensor, next_token: torch.Tensor, logprob: torch.Tensor,
                stops: torch.Tensor) -> None:
    """``RowState.advance``, in place."""
    column = local.clamp(max=out_tokens.shape[1] - 1)[:, None]
    out_tokens.scatter_(1, column, next_token[:, None])
    out_logprobs.scatter_(1, column, logprob[:, None])
    token.copy_(next_token[:, None])  # not a view of next_token: a graph's output buffer is reused by its next replay
    local.add_(1)
    done.logical_or_(stops[next_token] | (local >= budget))


class EpisodeRows:
    """Device state of B rows that play multi-turn episodes (``Sampler.generate_episodes``), fixed shapes.

    Each row holds its episode's whole sequence so far (``seq``: prompt, sampled and appended
    ids), how many of those ids are known (``length``) and the position it feeds next
    (``pos``): every decode step feeds ``seq[pos]`` at ``pos``. Where ``pos + 1 < length`` the
    step only writes that id's key/value into the cache (a forced step: the ids appended
    after a turn go in this way); where ``pos + 1 == length`` it samples the next id with the
    turn's uniform ``uniforms[row, local]``. A row is done once its turn has sampled a stop
    token or ``budget`` ids; a done row keeps stepping (static shapes) without moving: it
    feeds the same id at the same position, which writes the same key/value again, and its
    outputs land in the spare columns.
    """

    def __init__(self, rows: int, width: int, slots: int, device: torch.device) -> None:
        self.width = width  # the most ids one turn samples
        self.spare = slots  # the column of seq that rows sampling nothing write into
        self.seq = torch.zeros(rows, slots + 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.length = torch.ones(rows, dtype=torch.long, device=device)
        self.local = torch.zeros(rows, dtype=torch.long, device=device)  # ids sampled in this turn so far
        self.budget = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)  # no episode yet: free
        self.uniforms = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.out_tokens = torch.zeros(rows, width + 1, dtype=torch.long, device=device)  # + a spare column
        self.out_logprobs = torch.zeros(rows, width + 1, dtype=torch.float32, device=device)

    def start(self, rows: list[int], sequences: list[list[int]], positions: list[int], budgets: list[int],
              uniforms: np.ndarray) -> None:
        """Start a turn in ``rows``: each row's whole sequence, the position it feeds from (its cache
        holds every id before it; only the ids from there on are written into ``seq``, the row
        never feeds the others again), its budget and the turn's uniforms (k, width)."""
        counts = [len(ids) - p for ids, p in zip(sequences, positions)]
        cells_rows = np.repeat(rows, counts)
        cells_cols = np.concatenate([np.arange(p, len(ids)) for ids, p in zip(sequences, positions)])
        values = np.concatenate([np.asarray(ids[p:], dtype=np.int64) for ids, p in zip(sequences, positions)])
        index, cells_rows, cells_cols, values, pos, length, budget = upload(
            [np.array(rows), cells_rows, cells_cols, values, np.array(positions), np.array([len(s) for s in sequences]),
             np.array(budgets)], self.seq.device, np.int64)
        self.seq[cells_rows, cells_cols] = values
        self.pos[index] = pos
        self.length[index] = length
        self.local[index] = 0
        self.budget[index] = budget
        self.done[index] = False
        self.uniforms[index] = upload([uniforms], self.seq.device)[0]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens (B, 1), positions (B, 1), uniforms (B,)) of the next decode step."""
        uniforms = self.uniforms.gather(1, self.local.clamp(max=self.width - 1)[:, None]).squeeze(1)
        return self.seq.gather(1, self.pos[:, None]), self.pos[:, None], uniforms

    def advance(self, next_token: torch.Tensor, logprob: torch.Tensor, stops: torch.Tensor) -> None:
        """Record one decode step's (B,) tokens and log-probs where rows sampled; ``stops`` as in ``RowState.advance``."""
        sampling = ~self.done & (self.pos + 1 == self.length)
        column = torch.where(sampling, self.local, self.width)[:, None]
        self.out_tokens.scatter_(1, column, next_token[:, None])
        self.out_logprobs.scatter_(1, column, logprob[:, None])
        self.seq.scatter_(1, torch.where(sampling, self.length, self.spare)[:, None], next_token[:, None])
        self.length += sampling
        self.local += sampling
        self.pos += ~self.done
        self.done |= sampling & (stops[next_token] | (self.local >= self.budget))

    def turns(self, rows: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """The ids and log-probs each of ``rows`` sampled in its current turn."""
        index = torch.tensor(rows, device=self.seq.device)
        counts = self.local[index].tolist()
        tokens, logprobs = self.out_tokens[index].tolist(), self.out_logprobs[index].tolist()
        return ([t[:n] for t, n in zip(tokens, counts)], [p[:n] for p, n in zip(logprobs, counts)])
