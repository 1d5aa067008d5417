"""What the loop does with each step's ledger line: record it, or compare it (replay).

A recording run (``LedgerWriter``) appends the line to ``ledger.jsonl`` (rank 0) and is the
only kind of run that checkpoints, evaluates or stops on a signal. A replay
(``ReplayComparator``, ``--replay RUN --step S``) writes nothing into the replayed run: it
restores the newest checkpoint before S, compares every replayed line with the recorded one
and raises ``DeterminismError`` (exit 5) on the first difference, and optionally dumps
step S (``--dump``). The trainer talks to either through the same ``StepRecorder`` methods
and never branches on which one it has.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Protocol

from torch import nn

from core import layout
from core.distributed_context import DistributedContext
from core.exceptions import CheckpointError, DeterminismError
from core.layout import step_dir_name
from core.logging import get_logger
from training.record import ledger as ledger_lib
from training.checkpoint.manifest import read_latest


class StepRecorder(Protocol):
    records: bool
    """True for a recording run: it checkpoints, evaluates and stops on signals."""
    restored_event: str
    """The event emitted when a checkpoint was restored."""

    def last_step(self, max_steps: int) -> int: ...

    def restore_limit(self) -> int | None:
        """The newest checkpoint step the run may restore (None: any)."""
        ...

    def restored(self, step: int) -> None:
        """The run continues after ``step``: later ledger lines are void."""
        ...

    def instrument(self, model: nn.Module, step: int) -> ContextManager: ...

    def param_hash_due(self, step: int, checkpoint_due: bool, max_steps: int) -> bool: ...

    def record(self, step: int, record: dict[str, Any], batch) -> None: ...

    def recorded_frozen(self) -> dict[str, dict[str, str]] | None:
        """The frozen models a run that restores no checkpoint must have (None: any)."""
        ...


class LedgerWriter:
    """A recording run: rank 0 appends each line to the run's ledger.

    Before a resumed run drops the lines after its restored checkpoint, the ledger must be
    whole (``ledger.check_sequence``, ``ledger.check_covers``), and lines after that
    checkpoint may be dropped only when nothing shows that a newer checkpoint existed: a
    run dir whose ``checkpoints/`` is gone, whose ``LATEST`` names a missing directory, or
    whose ledger proves a checkpoint that is no longer there is refused (CheckpointError,
    exit 4) instead of restarting over its record."""

    records = True
    restored_event = "resumed"

    def __init__(self, path: Path, dist: DistributedContext) -> None:
        self.ledger = ledger_lib.Ledger(path, writer=dist.is_main)
        self.dist = dist
        # The ledger sits beside checkpoints/ in the run dir (core.layout). Whether that dir
        # exists is read now: the checkpoint manager, built next, creates it again.
        self.checkpoint_dir = path.parent / layout.CHECKPOINTS_DIR
        self._had_checkpoint_dir = self.checkpoint_dir.is_dir()

    def last_step(self, max_steps: int) -> int:
        return max_steps

    def restore_limit(self) -> int | None:
        return None

    def restored(self, step: int) -> None:
        problem = self._unresumable(step) if self.dist.is_main else None
        problem = self.dist.broadcast_object(problem)  # every rank stops, not only the writer
        if problem is not None:
            raise problem
        self.ledger.truncate_after(step)

    def _unresumable(self, step: int) -> CheckpointError | None:
        """Why the run cannot continue after checkpoint ``step`` (0: none) over its ledger, or None."""
        path = self.ledger.path
        try:
            contents = ledger_lib.read_contents(path)
            ledger_lib.check_sequence(contents.records, path)
            ledger_lib.check_covers(contents, step, path)
        except CheckpointError as error:
            return error
        except OSError as error:
            return CheckpointError(f"cannot read the ledger: {error}", file=str(path))
        if contents.last_step <= step:
            return None  # no line would be dropped
        evidence = self._lost_checkpoint(contents.records, step)
        if evidence is None:
            return None
        restart = f"from checkpoint step {step}" if step else "at step 1"
        return CheckpointError(
            f"{evidence}, and ledger.jsonl has lines up to step {contents.last_step}: resuming {restart} "
            f"would write steps {step + 1}..{contents.last_step} over them",
            path=str(self.checkpoint_dir),
            hint="restore the checkpoints from a copy of the run dir; to train it again from that step anyway, "
            "move ledger.jsonl aside too (the run then writes a new one)",
        )

    def _lost_checkpoint(self, records: list[dict[str, Any]], step: int) -> str | None:
        """Evidence that a checkpoint newer than ``step`` existed and is gone, or None."""
        if not self._had_checkpoint_dir:
            return f"{self.checkpoint_dir} is missing (every run creates it)"
        latest = read_latest(self.checkpoint_dir)
        if latest is not None and latest > step and not (self.checkpoint_dir / step_dir_name(latest)).is_dir():
            return f"checkpoints/LATEST names step {latest}, whose directory {step_dir_name(latest)} is missing"
        proven = ledger_lib.completed_checkpoint_step(records)
        if step == 0 and proven is not None:
            return (f"no checkpoint is left, yet the ledger shows the checkpoint of step {proven} was written "
                    "(lines go on past the next checkpoint step, which waits for it)")
        return None

    def instrument(self, model: nn.Module, step: int) -> ContextManager:
        return contextlib.nullcontext()

    def param_hash_due(self, step: int, checkpoint_due: bool, max_steps: int) -> bool:
        """Checkpoint steps and the last step."""
        return checkpoint_due or step == max_steps

    def record(self, step: int, record: dict[str, Any], batch) -> None:
        self.ledger.append(record)

    def recorded_frozen(self) -> dict[str, dict[str, str]] | None:
        return None  # a run from step 1 chooses its frozen models


@dataclass
class ReplaySpec:
    """Replay steps up to ``step`` and compare them with ``recorded`` ledger lines."""

    step: int
    recorded: dict[int, dict[str, Any]]
    dump: Any = None  # training.record.replay.StepDump: instruments and writes step ``step``
    frozen: dict[str, dict[str, str]] | None = None
    """The frozen models the run recorded (training.record.replay.recorded_frozen), None if none."""


class ReplayComparator:
    """A replay: compares each line with the recorded one, dumps step ``spec.step``."""

    records = False
    restored_event = "replay_restored"

    def __init__(self, spec: ReplaySpec, dist: DistributedContext) -> None:
        self.spec = spec
        self.dist = dist

    def last_step(self, max_steps: int) -> int:
        return self.spec.step

    def restore_limit(self) -> int | None:
        return self.spec.step - 1

    def restored(self, step: int) -> None:
        pass

    def recorded_frozen(self) -> dict[str, dict[str, str]] | None:
        return self.spec.frozen

    def instrument(self, model: nn.Module, step: int) -> ContextManager:
        if self.spec.dump is not None and step == self.spec.step:
            return self.spec.dump.attach(model)
        return contextlib.nullcontext()

    def param_hash_due(self, step: int, checkpoint_due: bool, max_steps: int) -> bool:
        """Where the recorded line has one."""
        return "param_hash" in self.spec.recorded.get(step, {})

    def record(self, step: int, record: dict[str, Any], batch) -> None:
        expected = self.spec.recorded.get(step)
        if expected is None:
            raise DeterminismError(f"the run's ledger has no line for step {step}", step=step)
        field_name = ledger_lib.first_mismatch(expected, record)
        if field_name is not None:
            raise DeterminismError(
                f"{field_name} differs: recorded {expected.get(field_name)!r}, replayed {record.get(field_name)!r}",
                step=step,
                field=field_name,
                rank="all" if self.dist.world_size > 1 else 0,
                hint="compare meta.json environments; see docs/determinism.md",
            )
        get_logger().info("replay step %d matches the ledger", step)
        if step == self.spec.step and self.spec.dump is not None:
            self.spec.dump.write(batch, record)
