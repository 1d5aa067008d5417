"""``runs plot``: every numeric series of a run, grouped, as one PNG per run, and a comparison.

Series of a run (``run_series``), each a list of ``(step, value)``:

- every numeric ledger field (``loss``, ``grad_norm``, ``lr``, ``reward_mean``, ``accuracy``, ...;
  a list of numbers such as ``inner_losses`` gives ``inner_losses[i]``);
- every metric of ``metrics.jsonl`` the ledger does not already hold exactly (its mean over
  ranks: ``tokens_per_s``, ``mfu``, ``step_time``, ``objective/kl``, memory, phase times);
- every evaluation (``eval`` events): ``eval/loss`` and ``eval/<metric>``.

A resumed run re-executes the steps after its last checkpoint; the last record of a step wins,
so the curves show the run that continued.

Panels are grouped (``GROUPS``: loss, optimisation, rewards and accuracy, log-probs, critic (a
value model's loss, clipped fraction and explained variance: PPO's), KL and clipping, counts,
throughput and time, memory, other), one row of panels per group. An
evaluation metric is drawn on the panel of the training series of the same name (as markers,
labelled ``eval``), or on a panel of its own; the eval loss has its own panel, since it may be
averaged over other units than the training loss (pairs, prompts). Next to each PNG a JSON file
of the same name lists every panel's lines as drawn (read back from the figure's axes), for
tools and tests.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

from core import layout
from experiments.events import iter_jsonl, read_events

Series = list[tuple[int, float]]
EVAL_PREFIX = "eval/"

# (group title, words): a series belongs to the first group one of whose words is in its base
# name (words of two letters, such as ``kl``, must be a whole ``_``-separated part of it).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rewards and accuracy", ("reward", "accurac", "margin", "pass@", "score_min", "score_max")),
    ("log-probs", ("logp", "entropy")),
    ("critic", ("value_", "explained_variance")),
    ("KL and clipping", ("kl", "divergence", "clip")),
    ("throughput and time", ("tokens_per_s", "mfu", "step_time", "time_")),
    ("memory", ("mem", "gib")),
    ("loss", ("loss", "ce")),
    ("optimisation", ("grad_norm", "lr")),
    ("counts", ("tokens", "pairs", "len", "errors", "records")),
)
OTHER = "other"
# The rows' order in a figure.
DISPLAY_ORDER = ("loss", "optimisation", "rewards and accuracy", "log-probs", "critic", "KL and clipping", "counts",
                 "throughput and time", "memory", OTHER)
COLUMNS = 4
# The ledger's keys that are not series of the run's progress.
_NOT_SERIES = ("step", "time")


def run_series(run_dir: Path) -> dict[str, Series]:
    """Every numeric series of a run, by name (see the module docstring)."""
    ledger = _by_step(iter_jsonl(run_dir / layout.LEDGER_FILE))
    metrics = _by_step(iter_jsonl(run_dir / layout.METRICS_FILE))
    out: dict[str, Series] = {}
    for step, record in ledger.items():
        for name, value in record.items():
            if name in _NOT_SERIES:
                continue
            if isinstance(value, list):
                for i, item in enumerate(value):
                    _add(out, f"{name}[{i}]", step, item)
            else:
                _add(out, name, step, value)
    in_ledger = set(out)
    for step, record in metrics.items():
        for name in ("tokens_per_s", "mfu"):
            _add(out, name, step, record.get(name))
        for name, stats in (record.get("metrics") or {}).items():
            if name not in in_ledger and isinstance(stats, dict):
                _add(out, name, step, stats.get("mean"))
    for event in read_events(run_dir / layout.EVENTS_FILE):
        if event.event != "eval" or not isinstance(event.fields.get("step"), int):
            continue
        step = event.fields["step"]
        _add(out, EVAL_PREFIX + "loss", step, event.fields.get("loss"))
        for name, value in (event.fields.get("metrics") or {}).items():
            _add(out, EVAL_PREFIX + name, step, value)
    for name in out:  # the last record of a re-executed step wins
        out[name] = sorted(dict(out[name]).items())
    return out


def curves(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every series as ``(steps, values)``; ``loss``, ``lr`` and ``tokens_per_s`` always present."""
    series = run_series(run_dir)
    out = {name: ([], []) for name in ("loss", "lr", "tokens_per_s")}
    for name, points in series.items():
        out[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def group_of(name: str) -> str:
    """The group of a series: by its base name (without ``eval/``, ``objective/``, ...)."""
    base = name.rsplit("/", 1)[-1].lower()
    parts = set(re.split(r"[_\[\]]", base))
    for title, words in GROUPS:
        if any(word in parts if len(word) <= 2 else word in base for word in words):
            return title
    return OTHER


def panels(series: dict[str, Series]) -> list[tuple[str, str, dict[str, Series]]]:
    """``(group, title, {label: points})`` per panel, groups in ``GROUPS`` order: a training
    series with the evaluation series of the same base name beside it (label ``eval``)."""
    train = {n: p for n, p in series.items() if not n.startswith(EVAL_PREFIX)}
    evals = {n[len(EVAL_PREFIX):]: p for n, p in series.items() if n.startswith(EVAL_PREFIX)}
    placed: dict[str, dict[str, Series]] = {name: {"train": points} for name, points in train.items()}
    for name, points in evals.items():
        home = _training_twin(name, train) if name != "loss" else None
        if home is None:
            placed[EVAL_PREFIX + name] = {"eval": points}
        else:
            placed[home]["eval"] = points
    return sorted(((group_of(n), n, lines) for n, lines in placed.items()), key=_display_key)


def plot_run(run_dir: Path, out: Path) -> Path:
    """One run's series as one PNG (and its JSON of the lines drawn); returns the PNG's path."""
    return _draw(panels(run_series(run_dir)), out, title=run_dir.name)


def plot_comparison(run_dirs: list[Path], out: Path) -> Path:
    """Every series of several runs, one line per run, as one PNG (and its JSON)."""
    by_run = {d.name: run_series(d) for d in run_dirs}
    names = sorted({n for series in by_run.values() for n in series})
    laid = sorted(((group_of(n), n, {run: series[n] for run, series in by_run.items() if n in series})
                   for n in names), key=_display_key)
    return _draw(laid, out, title="runs: " + ", ".join(by_run))


def comparison_path(root: Path, run_dirs: Iterable[Path]) -> Path:
    """Where a comparison goes by default: ``<root>/compare-<8 hex of the run IDs>.png``."""
    digest = hashlib.sha256("\n".join(sorted(d.name for d in run_dirs)).encode()).hexdigest()[:8]
    return root / f"compare-{digest}.png"


def series_path(png: Path) -> Path:
    """The JSON of the lines drawn into ``png``."""
    return png.with_suffix(".json")


# ---------------------------------------------------------------------------- drawing


def _draw(laid: list[tuple[str, str, dict[str, Series]]], out: Path, *, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = _rows(laid)
    height = 3 * max(len(rows), 1)
    fig = Figure(figsize=(4 * COLUMNS, height))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(max(len(rows), 1), COLUMNS)
    drawn: list[dict[str, Any]] = []
    for r, row in enumerate(rows):
        for c, (group, name, lines) in enumerate(row):
            ax = fig.add_subplot(grid[r, c])
            for label, points in lines.items():
                few = len(points) < 50 or label == "eval"
                ax.plot([s for s, _ in points], [v for _, v in points], label=label,
                        marker="o" if label == "eval" else ("." if few else None),
                        linestyle="--" if label == "eval" else "-")
            ax.set_title(f"{group}: {name}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.3)
            if len(lines) > 1:
                ax.legend(fontsize=7)
            drawn.append({"group": group, "series": name, "lines": {
                line.get_label(): [[int(x), float(y)] for x, y in zip(line.get_xdata(), line.get_ydata())]
                for line in ax.get_lines()}})
    if not rows:
        fig.text(0.5, 0.5, "no data", ha="center", va="center")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / height))  # room for the title
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    series_path(out).write_text(json.dumps({"title": title, "panels": drawn}, indent=1) + "\n")
    return out


def _rows(laid: list[tuple[str, str, dict[str, Series]]]) -> list[list[tuple[str, str, dict[str, Series]]]]:
    """Each group starts a new row of at most COLUMNS panels."""
    rows: list[list] = []
    for panel in laid:
        if not rows or rows[-1][0][0] != panel[0] or len(rows[-1]) == COLUMNS:
            rows.append([])
        rows[-1].append(panel)
    return rows


def _display_key(panel: tuple[str, str, Any]) -> tuple[int, bool, str]:
    """Groups in DISPLAY_ORDER; in a group, the series named like it (``loss``) first, then by name."""
    group, name, _ = panel
    return DISPLAY_ORDER.index(group), name != group, name


def _training_twin(name: str, train: dict[str, Series]) -> str | None:
    """The training series an evaluation metric is drawn with: the same name (a ledger field
    or a metric), else the objective's per-unit mean of it."""
    for candidate in (name, f"objective/{name}"):
        if candidate in train:
            return candidate
    return None


def _by_step(records: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for record in records:
        if isinstance(record.get("step"), int):
            out[record["step"]] = record
    return out


def _add(out: dict[str, Series], name: str, step: int, value: Any) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out.setdefault(name, []).append((step, float(value)))
