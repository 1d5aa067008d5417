"""Raise an error from a signal handler at the next line of Lockstep's own code, never inside a library.

A Python signal handler runs between two bytecodes of whatever the main thread executes. An
exception raised there lands at that point, and library code is not written for that: torch's
``handle_torch_function`` pops the mode stack in a context manager's ``__exit__`` and pushes it
back in the next statement, so a SIGTERM between the two while a model is built under
``with torch.device("meta")`` left the stack empty ("trying to pop from empty mode stack") or the
meta device mode behind (later tensors came out on "meta" and a storage error followed): exit 1
instead of the stop's 143 (runtime/signals.py, ``StopSignals.at_once``; tests/training/
test_probe_training_defects.py reproduces it).

``raise_in_own_code(frame, error)`` instead traces the frames of this repository's files on the
interrupted stack (and any entered later) and raises ``error`` at the first line event (a new
line, or a return) in one of them: library calls below it have returned by then, or it is a
callee of theirs (a module's ``__init__`` that ``nn.ModuleList`` calls), from which an exception
is ordinary control flow every library must handle. Tracing lasts until then: a library call
that runs for a while delays the error by at most its own duration.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
_OWN = str(ROOT) + "/"


def is_own_code(filename: str) -> bool:
    """Whether ``filename`` is one of this repository's source files (not an installed package)."""
    return filename.startswith(_OWN) and "site-packages" not in filename


def raise_in_own_code(frame: Optional[FrameType], error: BaseException) -> None:
    """Arrange for ``error`` to be raised at the next line of this repository's code (module
    docstring); call it from a signal handler with the handler's ``frame``."""
    marked: list[FrameType] = []

    def fire(*_: Any) -> None:
        sys.settrace(None)
        for each in marked:
            each.f_trace = None
        raise error

    def local(frame: FrameType, event: str, arg: Any) -> Optional[Callable]:
        if event in ("line", "return"):
            fire()
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Optional[Callable]:
        if event == "call" and is_own_code(frame.f_code.co_filename):
            return local  # its first line raises
        return None  # a library frame runs untraced

    while frame is not None:
        if is_own_code(frame.f_code.co_filename):
            frame.f_trace = local
            frame.f_trace_lines = True
            marked.append(frame)
        frame = frame.f_back
    sys.settrace(calls)
