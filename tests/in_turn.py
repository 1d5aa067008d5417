"""``python tests/in_turn.py --preload MODULE OUT_DIR SCRIPT -- ARGS... [-- ARGS...]``: one-process
runs of SCRIPT, one for each ARGS list, one after the other, each forked from this process once it
has imported MODULE (as tests/ranks.py forks its ranks): the runs share that import, about 2.7 s of
CPU on the 2-core test machine, instead of paying it each (tests/launch.py, ``train_in_turn``).

A run is what ``python SCRIPT ARGS`` is: SCRIPT as ``__main__``, its folder first on the module
path, no rank environment. Run ``i`` (from 0) writes its stdout and stderr to ``OUT_DIR/i.out`` and
``OUT_DIR/i.err`` and its exit code (-N: killed by signal N) to ``OUT_DIR/i.code``; a run's failure
does not stop the next. Exits 0 once every run has ended.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from ranks import PRELOAD_FLAG, preload

SEPARATOR = "--"


def become_run(script: str, args: list[str], out: Path, err: Path) -> None:
    """In a forked child: ``python SCRIPT ARGS`` with stdout and stderr in ``out`` and ``err``.
    Never returns (as tests/ranks.py's ``become_rank``)."""
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def run(module: str, out_dir: Path, script: str, runs: list[list[str]]) -> None:
    preload(script, module)
    for index, args in enumerate(runs):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            become_run(script, args, out_dir / f"{index}.out", out_dir / f"{index}.err")
        _, status = os.waitpid(pid, 0)
        (out_dir / f"{index}.code").write_text(str(os.waitstatus_to_exitcode(status)))


def split_runs(argv: list[str]) -> list[list[str]]:
    """``-- A B -- C`` -> ``[[A, B], [C]]``."""
    if not argv or argv[0] != SEPARATOR:
        raise SystemExit(f"in_turn.py: the runs' arguments start with {SEPARATOR}, got {argv[:1]}")
    runs: list[list[str]] = []
    for item in argv:
        if item == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(item)
    return runs


if __name__ == "__main__":
    flag, module, out_dir, script, *rest = sys.argv[1:]
    if flag != PRELOAD_FLAG:
        raise SystemExit(f"in_turn.py: usage: {__doc__.splitlines()[0]}")
    run(module, Path(out_dir), script, split_runs(rest))
