"""Whether this interpreter has Lockstep's dependencies: the ``.venv`` that ``make setup`` builds.

Checked first by every entry point (``train.py``, ``python -m training|data|experiments``,
``scripts/*.py``), with the standard library only, so that one run from an interpreter
without them says what to do in one line instead of ending in a ``ModuleNotFoundError``
traceback.
"""

from __future__ import annotations

import importlib.util
import sys

from core.exceptions import UsageError

# The import names of the dependencies train.py's first imports need (pyproject.toml).
REQUIRED_MODULES = ("torch", "yaml", "numpy", "psutil", "pyarrow", "zstandard")


def require_dependencies(script: str, modules: tuple[str, ...] = REQUIRED_MODULES) -> None:
    """Exit 2 with one line on stderr when one of ``modules`` is not installed here; ``script``
    is how the hint runs the entry point with .venv's Python (``train.py``, ``-m data``)."""
    missing = [name for name in modules if not _installed(name)]
    if not missing:
        return
    error = UsageError(
        f"{sys.executable} has no {', '.join(missing)}: Lockstep runs in its own environment, .venv",
        hint=f"run `make setup` once, then `. .venv/bin/activate` (or call `.venv/bin/python {script}`)",
    )
    print(error, file=sys.stderr, flush=True)
    raise SystemExit(error.exit_code)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
