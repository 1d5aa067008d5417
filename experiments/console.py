"""What a training method shows on the console, and progress while a long phase runs.

A method declares its console lines (``ConsoleLines``: one for the training steps, one for
evaluations): the unit its loss is averaged over (tokens, pairs, completions, prompts), the
label of the loss (``None`` where the loss is only a sign-flipped field, as GRPO's evaluation
loss is minus the reward) and the fields beside it. A field names a metric: a per-unit mean of
one of the method's metric sums (``objective/<name>``) or a ledger field of the method
(``reward_mean``, ``trained_tokens``), as the trainer hands them to the metrics tracker.

``Progress`` counts the items of a long phase (evaluation batches, a step's rollouts): a
transient ``rich`` progress bar when stdout is a terminal, plain lines at most every
``interval_s`` seconds otherwise (logs and pipes keep readable lines, no carriage returns).

``Heartbeat`` keeps a run from going quiet: a background thread writes a line (the step in
progress and what it is doing) whenever no line has been written for ``HEARTBEAT_S`` seconds,
whatever the step is waiting for (rollouts, a slow update, a checkpoint). It only reads host
values the loop hands it; it never touches a device or the ledger.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

HEARTBEAT_S = 30.0
"""The longest a run stays quiet: a heartbeat line after this many seconds without a line."""


@dataclass(frozen=True)
class ConsoleField:
    """One number on a console line: ``label value``."""

    label: str
    metric: str
    """The metric's name: ``objective/<metric sum>`` (a per-unit mean) or a ledger field."""
    spec: str = ".4f"


@dataclass(frozen=True)
class ConsoleLine:
    """A step or eval line of one method."""

    unit: str = "token"
    """What the loss is averaged over, singular (``token``, ``pair``, ``completion``, ``prompt``)."""
    loss: str | None = "loss"
    """The loss's label; None: the loss is not shown (a field says the same thing)."""
    fields: tuple[ConsoleField, ...] = ()

    @property
    def units(self) -> str:
        return self.unit + "s"


@dataclass(frozen=True)
class ConsoleLines:
    """A method's console: its step line and its eval line."""

    step: ConsoleLine = ConsoleLine()
    eval: ConsoleLine = ConsoleLine()


def format_fields(values: Mapping[str, float], line: ConsoleLine, *, per_unit: bool = True) -> list[str]:
    """The ``label value`` parts of ``line`` whose metric is in ``values``; the loss (``values["loss"]``)
    first, ``loss 0.6931 per pair`` when ``per_unit``."""
    parts = []
    if line.loss is not None and "loss" in values:
        parts.append(f"{line.loss} {values['loss']:.4f}" + (f" per {line.unit}" if per_unit else ""))
    for field in line.fields:
        if field.metric in values:
            parts.append(f"{field.label} {format(values[field.metric], field.spec)}")
    return parts


def eval_line(step: int, count: int, values: Mapping[str, float], line: ConsoleLine) -> str:
    """``eval step 10 over 64 pairs: loss 0.6931 | accuracy 0.6250 | ...``; with no unit evaluated
    (no held-out source, other evaluations only), ``eval step 10: <other fields>``."""
    if count == 0:
        return f"eval step {step}: " + " | ".join(format_fields({k: v for k, v in values.items() if k != "loss"},
                                                                line, per_unit=False))
    parts = format_fields(values, line, per_unit=False)
    return f"eval step {step} over {count} {line.units if count != 1 else line.unit}: " + " | ".join(parts)


class Progress:
    """Counts ``total`` items of a phase on the console (rank 0 builds one; others pass
    ``enabled=False``). Use as a context manager; ``advance()`` after each item."""

    def __init__(self, label: str, total: int, *, unit: str, enabled: bool = True,
                 print_fn: Callable[[str], None] | None = None, tty: bool | None = None,
                 interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.enabled = enabled
        self._print = print_fn or _print_flush
        self._tty = sys.stdout.isatty() if tty is None else tty
        self._interval_s = interval_s
        self._clock = clock
        self._done = 0
        self._started = self._last = 0.0
        self._bar = None  # rich.progress.Progress on a terminal
        self._task = None

    def __enter__(self) -> "Progress":
        self._started = self._last = self._clock()
        if self.enabled and self._tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn(self.unit), TimeElapsedColumn(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        return self

    def extend(self, items: int) -> None:
        """``items`` more to count (a rollout's re-sampled groups)."""
        self.total += items
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def advance(self, items: int = 1) -> None:
        self._done += items
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self._done)
            return
        now = self._clock()
        if now - self._last >= self._interval_s and self._done < self.total:
            self._last = now
            self._print(self.line(now))

    def line(self, now: float) -> str:
        """``eval step 40: 12/32 batches, 14.2 s``."""
        return f"{self.label}: {self._done}/{self.total} {self.unit}, {now - self._started:.1f} s"

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class Heartbeat:
    """A line at least every ``interval_s`` seconds while a run works (rank 0 builds one enabled;
    others pass ``enabled=False``): ``step 37/200 running (prepare): 95 s into the step, 30 s since
    the last line``.

    The loop says which step runs and what it does (``at``) and that a line was written
    (``touch``: a step line). ``tick()`` writes the line when one is due; ``start()`` runs it in a
    daemon thread every ``period_s`` and, with ``listen``, counts every record of that logger as a
    line (eval and progress lines) until ``stop()``."""

    def __init__(self, total_steps: int, *, enabled: bool = True, print_fn: Callable[[str], None] | None = None,
                 interval_s: float = HEARTBEAT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps, self.enabled, self.interval_s = total_steps, enabled, interval_s
        self._print = print_fn or _print_flush
        self._clock = clock
        self._lock = threading.Lock()
        self._last = self._step_started = clock()
        self._step: int | None = None
        self._doing = "starting"
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._listening: tuple[logging.Logger, logging.Handler] | None = None

    def at(self, step: int, doing: str = "running") -> None:
        """Step ``step`` is in progress, doing ``doing`` (``running (prepare)``, ``evaluating``)."""
        with self._lock:
            if step != self._step:
                self._step, self._step_started = step, self._clock()
            self._doing = doing

    def touch(self) -> None:
        """A line was just written: the next heartbeat is ``interval_s`` from now."""
        with self._lock:
            self._last = self._clock()

    def line(self, now: float) -> str:
        quiet = f"{now - self._last:.0f} s since the last line"
        if self._step is None:
            return f"{self._doing}: {quiet}"
        return (f"step {self._step}/{self.total_steps} {self._doing}: {now - self._step_started:.0f} s into the "
                f"step, {quiet}")

    def tick(self) -> str | None:
        """Write the heartbeat line if ``interval_s`` have passed since the last line; returns it."""
        if not self.enabled:
            return None
        with self._lock:
            now = self._clock()
            if now - self._last < self.interval_s:
                return None
            text = self.line(now)
            self._last = now
        self._print(text)
        return text

    def start(self, period_s: float = 1.0, *, listen: logging.Logger | None = None) -> None:
        if not self.enabled or self._thread is not None:
            return
        self.touch()
        if listen is not None:
            self._listening = (listen, _Touch(self))
            listen.addHandler(self._listening[1])
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._listening is not None:
            logger, handler = self._listening
            logger.removeHandler(handler)
            self._listening = None

    def _run(self, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            try:
                self.tick()
            except Exception:  # a closed stream at shutdown: the heartbeat is never worth a crash
                return

class _Touch(logging.Handler):
    """Tells a heartbeat that a line was written."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        super().__init__(logging.INFO)
        self._heartbeat = heartbeat
        # Events go to the rank's log file only (core/logging.py), never to the console.
        self.addFilter(lambda record: not record.name.endswith(".events"))

    def emit(self, record: logging.LogRecord) -> None:
        self._heartbeat.touch()


def _print_flush(line: str) -> None:
    print(line, flush=True)


__all__ = ["HEARTBEAT_S", "ConsoleField", "ConsoleLine", "ConsoleLines", "Heartbeat", "Progress", "eval_line",
           "format_fields"]
