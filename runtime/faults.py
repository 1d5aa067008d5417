"""Fault injection for tests and chaos runs (``runtime.faults``; off by default).

Entry grammar, one string per fault::

    kind@STEP            every rank at step STEP          nan@3, sigterm@6
    kind@STEP:RANK       only rank RANK                   hang@5:1, crash@7:0
    kind@step=S,rank=R   the same, spelled out (docs/contracts.md)
    slow_data            (slow_data only) every step, every rank

Kinds:

- ``hang``: the rank sleeps forever at the start of the step (the watchdog must catch it;
  the other ranks then block in their next collective and time out too).
- ``crash``: hard death with exit code 1 after flushing logs, like a lost node: no event,
  no checkpoint, no cleanup.
- ``crash_checkpoint``: the same death in the middle of step STEP's checkpoint save, once the
  rank has written its model/optimizer shards and before the checkpoint is published (a
  node lost mid-save: the save must not become ``LATEST``, and the other ranks must stop).
- ``sigterm``: the process sends SIGTERM to itself (a preemption notice): the stop
  handlers see a real signal.
- ``nan``: the loss of the step is replaced by NaN (keeping the autograd graph, so the
  gradients are NaN too) to exercise ``runtime.on_nonfinite``.
- ``slow_data``: fetching the step's batch is delayed by ``runtime.fault_slow_data_s``.
- ``logprob_drift``: under ``determinism.batch_invariant``, the trainer's log-prob of the first
  sampled token that step STEP's first update compares with the sampler's
  (training/objectives/logprob_parity.py) reaches the comparison moved to the next float toward
  zero, as a kernel outside the batch-invariant set would move it (the loss is untouched): every
  rank must stop with exit 5, before the step's ledger line and checkpoint. Nothing to compare
  (another method, the stock kernels): nothing happens.

Steps are the trainer's step numbers (the ledger's ``step``). A fault fires when its step
is executed for the first time in this process; a step re-executed in the same process
does not fire it again. A resumed run is a new process: if it re-executes the fault's step
(the step came after the last checkpoint) the fault fires again, unless the resume changes
``runtime.faults`` (all ``runtime.*`` keys are resumable).

A replay (``train.py --replay``) keeps only the faults that are part of what a step computes:
``nan`` (the recorded step's loss was NaN, and the replay must reproduce it, skipped or
aborted as the run was). It drops the process-level kinds (``hang``, ``crash``,
``crash_checkpoint``, ``sigterm``), which would stop the replay before it reaches the step
it was asked to verify, ``slow_data``, which only costs time, and ``logprob_drift``, whose step
stopped the run and so has no ledger line to verify (``for_replay``). The
run's recorded config keeps them all, whatever a resume overrode.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from core.exceptions import ConfigError

FAULT_KINDS = ("hang", "nan", "crash", "crash_checkpoint", "sigterm", "slow_data", "logprob_drift")
STEPLESS_KINDS = ("slow_data",)
STEP_START_KINDS = ("crash", "sigterm", "hang")  # fired by FaultInjector.before_step
REPLAYED_KINDS = ("nan",)  # change what the step computes: a replay must fire them too
CONFIG_KEY = "runtime.faults"
CRASH_EXIT_CODE = 1

_ENTRY = re.compile(r"^(?P<kind>[A-Za-z_]+)(?:@(?P<where>.*))?$")
_SHORT = re.compile(r"^(?P<step>-?\d+)(?::(?P<rank>-?\d+))?$")
_LONG_ITEM = re.compile(r"^(?P<key>step|rank)=(?P<value>-?\d+)$")


@dataclass(frozen=True)
class FaultSpec:
    """One parsed ``runtime.faults`` entry; ``None`` means every step / every rank."""

    kind: str
    step: int | None
    rank: int | None
    entry: str

    def applies(self, step: int, rank: int) -> bool:
        return (self.step is None or self.step == step) and (self.rank is None or self.rank == rank)


def parse_faults(entries: Sequence[str]) -> tuple[FaultSpec, ...]:
    """Parse every entry; a bad one raises ConfigError (exit 2) naming it and the key."""
    return tuple(parse_fault(entry, index=i) for i, entry in enumerate(entries))


def for_replay(faults: Sequence[FaultSpec]) -> tuple[FaultSpec, ...]:
    """The faults a replay fires: those of ``REPLAYED_KINDS`` (see the module docstring)."""
    return tuple(f for f in faults if f.kind in REPLAYED_KINDS)


def parse_fault(entry: str, *, index: int = 0) -> FaultSpec:
    key = f"{CONFIG_KEY}[{index}]"
    text = str(entry).strip()
    match = _ENTRY.match(text)
    if not match:
        raise _bad(entry, key, "expected kind@step[:rank]")
    kind = match["kind"]
    if kind not in FAULT_KINDS:
        near = difflib.get_close_matches(kind, FAULT_KINDS, n=1, cutoff=0.5)
        raise _bad(entry, key, f"unknown fault kind {kind!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    where = match["where"]
    if where is None:
        if kind not in STEPLESS_KINDS:
            raise _bad(entry, key, f"{kind} needs a step, e.g. {kind}@5")
        return FaultSpec(kind, None, None, text)
    step, rank = _parse_where(where.strip(), entry, key)
    if step is None and kind not in STEPLESS_KINDS:
        raise _bad(entry, key, f"{kind} needs a step, e.g. {kind}@5")
    if (step is not None and step < 0) or (rank is not None and rank < 0):
        raise _bad(entry, key, "step and rank must be >= 0")
    return FaultSpec(kind, step, rank, text)


def _parse_where(where: str, entry: str, key: str) -> tuple[int | None, int | None]:
    short = _SHORT.match(where)
    if short:
        rank = short["rank"]
        return int(short["step"]), (int(rank) if rank is not None else None)
    values: dict[str, int] = {}
    for item in where.split(","):
        long = _LONG_ITEM.match(item.strip())
        if not long or long["key"] in values:
            raise _bad(entry, key, f"cannot read {where!r}; write STEP, STEP:RANK or step=S,rank=R")
        values[long["key"]] = int(long["value"])
    return values.get("step"), values.get("rank")


def _bad(entry: str, key: str, why: str) -> ConfigError:
    return ConfigError(
        f"bad {CONFIG_KEY} entry {entry!r}: {why}",
        key=key,
        hint="write kind@step or kind@step:rank with kind one of " + ", ".join(FAULT_KINDS),
    )


class FaultInjector:
    """Fires this rank's faults at their steps. Call its hooks from the training loop.

    ``sleep``, ``kill`` and ``exit_fn`` are injectable so the firing logic can be tested
    without hanging or killing the test process.
    """

    def __init__(
        self,
        faults: Sequence[FaultSpec],
        *,
        rank: int,
        slow_data_s: float = 2.0,
        flush: Callable[[], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        kill: Callable[[int, int], None] = os.kill,
        exit_fn: Callable[[int], Any] = os._exit,
    ) -> None:
        self._faults = tuple(f for f in faults if f.rank is None or f.rank == rank)
        self._rank = rank
        self._slow_data_s = slow_data_s
        self._flush = flush
        self._sleep = sleep
        self._kill = kill
        self._exit = exit_fn
        self._fired: set[int] = set()

    @property
    def enabled(self) -> bool:
        return bool(self._faults)

    def before_step(self, step: int) -> None:
        """The step-start faults, in order: crash, sigterm, hang."""
        self.maybe_crash(step)
        self.maybe_sigterm(step)
        self.maybe_hang(step)

    def maybe_hang(self, step: int) -> None:
        if self._take("hang", step):
            self._announce(f"hang at step {step}")
            while True:  # only the watchdog (or a signal's exit) ends this
                self._sleep(3600.0)

    def maybe_crash(self, step: int) -> None:
        if self._take("crash", step):
            self._die(f"crash at step {step}")

    def maybe_crash_in_checkpoint(self, step: int) -> None:
        """Called by the checkpoint save of ``step`` once this rank's shards are written."""
        if self._take("crash_checkpoint", step):
            self._die(f"crash inside the checkpoint save of step {step}")

    def _die(self, what: str) -> None:
        self._announce(f"{what} (exit {CRASH_EXIT_CODE}, no cleanup)")
        if self._flush is not None:
            self._flush()
        _flush_stdio()
        self._exit(CRASH_EXIT_CODE)

    def maybe_sigterm(self, step: int) -> None:
        if self._take("sigterm", step):
            self._announce(f"SIGTERM to self at step {step}")
            self._kill(os.getpid(), signal.SIGTERM)

    def poison_loss(self, step: int, loss: Any) -> Any:
        """``loss`` times NaN for a ``nan`` fault (a tensor keeps its graph), else ``loss``."""
        if self._take("nan", step):
            self._announce(f"NaN loss at step {step}")
            return loss * float("nan")
        return loss

    def drift_logprob(self, step: int) -> bool:
        """Whether step ``step``'s exact comparison of the sampler's and the trainer's log-probs sees a
        trainer log-prob moved by one float (``logprob_drift``); asked once per compared micro-batch."""
        if self._take("logprob_drift", step):
            self._announce(f"a trainer log-prob of step {step} moved to the next float before the parity check")
            return True
        return False

    def slow_data_delay(self, step: int) -> float:
        """Seconds to sleep before handing out the step's batch (0.0 without a fault)."""
        return self._slow_data_s if self._take("slow_data", step) else 0.0

    def _take(self, kind: str, step: int) -> bool:
        """Whether a ``kind`` fault fires at ``step``; step-bound faults fire once."""
        for index, fault in enumerate(self._faults):
            if fault.kind != kind or not fault.applies(step, self._rank):
                continue
            if fault.step is None:
                return True
            if index not in self._fired:
                self._fired.add(index)
                return True
        return False

    def _announce(self, what: str) -> None:
        os.write(2, f"fault injection: rank {self._rank}: {what}\n".encode())


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
