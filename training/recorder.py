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

from core.distributed_context import DistributedContext
from core.exceptions import DeterminismError
from core.logging import get_logger
from training import ledger as ledger_lib


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


class LedgerWriter:
    """A recording run: rank 0 appends each line to the run's ledger."""

    records = True
    restored_event = "resumed"

    def __init__(self, path: Path, dist: DistributedContext) -> None:
        self.ledger = ledger_lib.Ledger(path, writer=dist.is_main)

    def last_step(self, max_steps: int) -> int:
        return max_steps

    def restore_limit(self) -> int | None:
        return None

    def restored(self, step: int) -> None:
        self.ledger.truncate_after(step)

    def instrument(self, model: nn.Module, step: int) -> ContextManager:
        return contextlib.nullcontext()

    def param_hash_due(self, step: int, checkpoint_due: bool, max_steps: int) -> bool:
        """Checkpoint steps and the last step."""
        return checkpoint_due or step == max_steps

    def record(self, step: int, record: dict[str, Any], batch) -> None:
        self.ledger.append(record)


@dataclass
class ReplaySpec:
    """Replay steps up to ``step`` and compare them with ``recorded`` ledger lines."""

    step: int
    recorded: dict[int, dict[str, Any]]
    dump: Any = None  # training.replay.StepDump: instruments and writes step ``step``


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
