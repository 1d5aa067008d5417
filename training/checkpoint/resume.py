"""Resume a run by its ID: find it, check what changed, and continue in the same run dir.

Only keys marked resumable in ``core.config.RESUMABLE_KEYS`` may differ from the recorded
config (cadences, logging, the number of steps, the parallel strategy and world size);
anything else is refused with the diff. A changed software or hardware environment is a
warning, or an error under ``runtime.strict_env``. The recorded config itself is verified
first (``core.run_context.load_recorded_config``): an edited config.yaml is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core import config as config_lib
from core.config import Config
from core.exceptions import ConfigError, ResumeError
from core.logging import get_logger
from core.layout import CONFIG_FILE, RunPaths
from core.run_context import determinism_env, load_recorded_config, run_paths
from experiments.runs import find_runs, recent_runs

AMBIGUOUS_SHOWN = 5
"""How many of the runs an ambiguous run ID prefix matches the error names."""


def find_run(root: str | Path, run_id: str) -> RunPaths:
    """The run ``run_id`` under ``root``, or the only run whose ID starts with it (the prefixes
    ``python -m experiments runs show`` accepts); a prefix of several runs is refused, naming them."""
    paths = run_paths(root, run_id)
    if paths.config.is_file():
        return paths
    matches = [p.name for p in find_runs(Path(root)) if p.name.startswith(run_id) and (p / CONFIG_FILE).is_file()]
    if len(matches) == 1:
        return run_paths(root, matches[0])
    if matches:
        shown = ", ".join(matches[:AMBIGUOUS_SHOWN]) + (", ..." if len(matches) > AMBIGUOUS_SHOWN else "")
        raise ResumeError(
            f"run ID prefix {run_id!r} matches {len(matches)} runs under {root}/: {shown}",
            run_id=run_id,
            hint="pass more of the run ID",
        )
    runs = recent_runs(Path(root), 3)
    raise ResumeError(
        f"no run {run_id!r} under {root}/",
        run_id=run_id,
        hint=(f"recent runs, newest first: {', '.join(runs)}" if runs else "pass --root DIR if the run lives elsewhere"),
    )


def resume_config(root: str | Path, run_id: str, overrides: list[str]) -> Config:
    """The recorded config with the allowed overrides applied; ResumeError lists forbidden changes.

    The recorded config is verified against meta.json's hash and the run ID first
    (``core.run_context.load_recorded_config``): nothing it names is used before that."""
    paths = find_run(root, run_id)
    recorded = load_recorded_config(paths)
    patched = config_lib.to_dict(recorded)
    for item in overrides:
        key, value = config_lib.parse_override(item)
        config_lib._set_dotted(patched, key, value)
    config = config_lib.from_dict(patched)
    config_lib.validate(config)
    changes = config_lib.diff(recorded, config)
    forbidden = [c for c in changes if not config_lib.is_resumable(c[0])]
    if forbidden:
        lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in forbidden)
        print("config diff (recorded -> requested):")
        for key, a, b in forbidden:
            print(f"  - {key}: {a!r}")
            print(f"  + {key}: {b!r}")
        raise ResumeError(
            f"cannot resume {run_id} with changed non-resumable keys: {lines}",
            run_id=run_id,
            hint="start a new run for a different model/data/optimizer; resumable keys: "
            + ", ".join(config_lib.RESUMABLE_KEYS),
        )
    return config


def check_environment(paths: RunPaths, config: Config, device, *, strict: bool) -> list[str]:
    """Differences between the recorded and the current determinism environment."""
    try:
        recorded = json.loads(paths.meta.read_text())["determinism"]
    except (OSError, ValueError, KeyError):
        return ["meta.json has no determinism record"]
    current = determinism_env(config, device)
    diffs = _flat_diff(recorded, current)
    if diffs:
        message = "environment differs from the recorded run: " + "; ".join(diffs)
        if strict:
            raise ResumeError(message, hint="run on the recorded environment or drop runtime.strict_env")
        get_logger().warning("%s (bitwise equality is not guaranteed)", message)
    return diffs


def _flat_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _flat_diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]


def parse_override_root(overrides: list[str]) -> str:
    """``run.root`` from the overrides (the run's own config is not read yet)."""
    for item in overrides:
        key, value = config_lib.parse_override(item)
        if key == "run.root":
            if not isinstance(value, str):
                raise ConfigError("run.root must be a string", key="run.root")
            return value
    return config_lib.RunConfig().root
