"""A step's episodes as text: ``python -m experiments runs episodes RUN_ID --step S``.

A run with an environment (``objective.grpo.environment`` or ``objective.ppo.environment``) keeps
every step's episodes in ``episodes/step_<NNNNNNNN>.json`` (written by
training/rollout/episode_store.py): by global row (``prompt row * group_size + sample``), per turn
the sampled ids, the observation ids, the tools called, the malformed calls and the outcome; the
episode's reward and counts. ``StepEpisodes.read`` loads one step's file; ``format_episodes``
writes it as text, each id list decoded by ``decode`` (the run's tokenizer, which the command line
builds from the run's config).

A run without an environment, or an agent run without the step's file, is a ``UsageError``
(exit 2) naming the file; a file that does not parse is a ``DataError`` (exit 3) naming it.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from core import layout
from core.exceptions import DataError, UsageError

VERSION = 1
"""The episode file version read here (training/rollout/episode_store.py's VERSION)."""


@dataclass(frozen=True)
class StepEpisodes:
    """One step's episodes of one run."""

    run_id: str
    step: int
    path: Path
    group_size: int
    tokenizer: str
    """The run's ``data.tokenizer`` (what decodes the ids)."""
    rows: dict[int, dict[str, Any]]
    """{global row: the episode's record}, by row."""

    @classmethod
    def read(cls, run_dir: Path, step: int) -> "StepEpisodes":
        config_path = run_dir / layout.CONFIG_FILE
        config = _read_config(config_path)
        objective = config.get("objective") or {}
        kind = objective.get("kind", "causal_lm")
        settings = objective.get(kind)  # a method that plays episodes has an ``environment`` in its section
        episodes_dir = run_dir / layout.EPISODES_DIR
        if not isinstance(settings, dict) or not settings.get("environment"):
            raise UsageError(
                f"run {run_dir.name} is not an agent run: {config_path} sets no objective.{kind}.environment, so it "
                f"records no episodes ({episodes_dir})",
                file=str(config_path), hint="runs episodes reads GRPO and PPO runs with objective.<kind>.environment")
        path = episodes_dir / layout.episodes_file_name(step)
        if not path.is_file():
            recorded = recorded_steps(run_dir)
            raise UsageError(
                f"step {step} of run {run_dir.name} has no episodes file {path}", file=str(path), step=step,
                hint=(f"it records steps {_ranges(recorded)}" if recorded else "the run has recorded no step yet")
                + "; pick one with --step")
        try:
            payload = json.loads(path.read_text())
            if payload.get("version") != VERSION or payload.get("step") != step:
                raise ValueError(f"version {payload.get('version')!r} step {payload.get('step')!r}, "
                                 f"expected version {VERSION} step {step}")
            rows = {int(row): record for row, record in payload["rows"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"the episodes file {path} is unreadable: {exc}", file=str(path), step=step,
                            hint="the run writes it at each step; restore it from a copy of the run dir") from None
        data = config.get("data") or {}
        return cls(run_id=run_dir.name, step=step, path=path, group_size=int(settings.get("group_size", 1)),
                   tokenizer=str(data.get("tokenizer", "byte")), rows=dict(sorted(rows.items())))


def recorded_steps(run_dir: Path) -> list[int]:
    """The steps whose episodes file the run holds, ascending."""
    folder = run_dir / layout.EPISODES_DIR
    if not folder.is_dir():
        return []
    steps = (layout.parse_step_dir_name(p.name.removesuffix(".json")) for p in folder.glob("*.json"))
    return sorted(s for s in steps if s is not None)


def format_episodes(episodes: StepEpisodes, decode: Callable[[list[int]], str]) -> str:
    """``episodes`` as text: a header, then per episode its row, prompt row, sample, reward and counts,
    and per turn its outcome, the tools it called and its sampled and observation text."""
    lines = [f"run {episodes.run_id} step {episodes.step}: {len(episodes.rows)} episodes, group_size "
             f"{episodes.group_size} ({episodes.path})"]
    for row, record in episodes.rows.items():
        lines += ["", _episode_header(row, record, episodes.group_size)]
        for number, turn in enumerate(record.get("turns", [])):
            calls = [name or "(malformed)" for name in turn.get("calls", [])]
            lines.append(f"  turn {number} ({turn.get('outcome', '?')})"
                         + (f", calls: {', '.join(calls)}" if calls else ""))
            lines += _block("sampled", turn.get("sampled", []), decode)
            if turn.get("observation"):
                lines += _block("observation", turn["observation"], decode)
    return "\n".join(lines)


def _episode_header(row: int, record: dict[str, Any], group_size: int) -> str:
    turns = record.get("turns", [])
    calls = sum(len(turn.get("calls", [])) for turn in turns)
    malformed = sum(turn.get("malformed", 0) for turn in turns)
    parts = [f"episode row {row}: prompt row {row // group_size}, sample {row % group_size}",
             f"reward {record.get('reward', float('nan')):.4f}",
             f"{len(turns)} turn{'s' if len(turns) != 1 else ''}",
             f"{calls} tool call{'s' if calls != 1 else ''}, {malformed} malformed"]
    if record.get("truncated"):
        parts.append("truncated")
    for name in ("reward_errors", "env_errors"):
        if record.get(name):
            parts.append(f"{name} {record[name]}")
    return " | ".join(parts)


def _block(label: str, ids: list[int], decode: Callable[[list[int]], str]) -> list[str]:
    text = decode([int(t) for t in ids])
    return [f"    {label} ({len(ids)} ids):", textwrap.indent(text, "      ", lambda line: True) if text else "      -"]


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} is missing: runs episodes reads the run's objective and tokenizer from it",
                         file=str(path)) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DataError(f"{path} is unreadable: {exc}", file=str(path)) from None
    if not isinstance(raw, dict):
        raise DataError(f"{path} is not a mapping", file=str(path))
    return raw


def _ranges(steps: list[int]) -> str:
    """``1-4, 7``."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)
