"""``runs plot``: every numeric series of a run, grouped, as one PNG per run, and a comparison.

Series of a run (``run_series``), each a list of ``(step, value)``:

- every numeric ledger field (``loss``, ``grad_norm``, ``lr``, ``reward_mean``, ``accuracy``, ...;
  a list of at most ``LIST_ELEMENTS`` numbers such as ``inner_losses`` gives ``inner_losses[i]``,
  a longer one its ``[mean]``, ``[min]`` and ``[max]`` over the elements);
- every metric of ``metrics.jsonl`` the ledger does not already hold exactly (its mean over
  ranks: ``tokens_per_s``, ``mfu``, ``step_time``, ``objective/kl``, memory, phase times);
- every evaluation (``eval`` events): ``eval/loss`` and ``eval/<metric>``.

A resumed run re-executes the steps after its last checkpoint; the last record of a step wins,
so the curves show the run that continued.

Panels are grouped (``GROUPS``: loss, optimisation, expert load, rewards and accuracy, log-probs, critic (a
value model's loss, clipped fraction and explained variance: PPO's), KL and clipping, counts,
throughput and time, memory, other), one row of panels per group. An
evaluation metric is drawn on the panel of the training series of the same name (as markers,
labelled ``eval``), or on a panel of its own; the eval loss has its own panel, since it may be
averaged over other units than the training loss (pairs, prompts). A list field's series share
one panel (lines ``[0]``, ``[1]``, ... or ``[mean]``, ``[min]``, ``[max]``).

Per-layer series (a mixture of experts' ``model/layer<i>_load_min``, ``_load_max``, ``_bias_min``,
``_bias_max``) share one panel per statistic, ``model/load_max`` and so on, in the group expert load
(beside ``model/aux/load_balance``): a line ``layer<i>`` per layer, or, past ``LIST_ELEMENTS``
layers, ``[mean]``, ``[min]`` and ``[max]`` over the layers. A comparison draws one line per run
for such a panel: its worst layer's (the largest of a ``max`` statistic, the smallest of a ``min``).

At most ``MAX_PANELS`` panels are drawn (a figure of thousands of panels takes minutes and shows
nothing), the first in display order, so series of the group ``other`` go first; ``patterns``
(``--series``, shell-style: ``loss``, ``objective/*``) choose which. What was left out, and every
line of the run's files that could not be read (skipped, as ``runs show`` skips it), is returned
with the plot (``Plot``) for the command to say. Next to each PNG a JSON file of the same name
lists every panel's lines as drawn (read back from the figure's axes), for tools and tests, and
the panels left out and lines skipped.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from core import layout
from core.exceptions import UsageError
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
    ("expert load", ("load_", "bias_")),
)
OTHER = "other"
# The rows' order in a figure.
DISPLAY_ORDER = ("loss", "optimisation", "expert load", "rewards and accuracy", "log-probs", "critic",
                 "KL and clipping", "counts", "throughput and time", "memory", OTHER)
COLUMNS = 4
MAX_PANELS = 32
"""Panels drawn by default (8 rows); ``--max-panels`` changes it, 0 draws every one."""
LIST_ELEMENTS = 8
"""A list field of at most this many numbers is drawn element by element; a longer one as its mean, min, max."""
# The ledger's keys that are not series of the run's progress.
_NOT_SERIES = ("step", "time")
_ELEMENT = re.compile(r"^(?P<base>.+)(?P<label>\[[^\[\]]+\])$")
# A per-layer series (a mixture of experts' ``model/layer3_load_max``): drawn with the other layers'.
_PER_LAYER = re.compile(r"^(?P<prefix>(?:.*/)?)layer(?P<layer>\d+)_(?P<stat>.+)$")


@dataclass(frozen=True)
class Plot:
    """A PNG written, what it left out and which lines of the run's files could not be read."""

    path: Path
    drawn: int
    left_out: list[str] = field(default_factory=list)
    skipped_lines: list[str] = field(default_factory=list)


def run_series(run_dir: Path, *, skipped: list[str] | None = None) -> dict[str, Series]:
    """Every numeric series of a run, by name (see the module docstring); each line of its files
    that cannot be read is skipped and appended to ``skipped`` (``"<file> line N: <reason>"``)."""
    ledger = _by_step(_records(run_dir / layout.LEDGER_FILE, skipped))
    metrics = _by_step(_records(run_dir / layout.METRICS_FILE, skipped))
    out: dict[str, Series] = {}
    for step, record in ledger.items():
        for name, value in record.items():
            if name in _NOT_SERIES:
                continue
            if isinstance(value, list):
                _add_list(out, name, step, value)
            else:
                _add(out, name, step, value)
    in_ledger = set(out)
    for step, record in metrics.items():
        for name in ("tokens_per_s", "mfu"):
            _add(out, name, step, record.get(name))
        for name, stats in (record.get("metrics") or {}).items():
            if name not in in_ledger and isinstance(stats, dict):
                _add(out, name, step, stats.get("mean"))
    bad: list[tuple[int, str]] = []
    events = read_events(run_dir / layout.EVENTS_FILE, skipped=bad)
    _note(run_dir / layout.EVENTS_FILE, bad, skipped)
    for event in events:
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
    series with the evaluation series of the same base name beside it (label ``eval``); a list
    field's series on one panel (labels ``[0]``, ``[mean]``, ...)."""
    train = {n: p for n, p in series.items() if not n.startswith(EVAL_PREFIX)}
    evals = {n[len(EVAL_PREFIX):]: p for n, p in series.items() if n.startswith(EVAL_PREFIX)}
    placed: dict[str, dict[str, Series]] = {}
    for name, points in train.items():
        element = _ELEMENT.match(name)
        if element:
            placed.setdefault(element["base"], {})[element["label"]] = points
        elif not _PER_LAYER.match(name):
            placed.setdefault(name, {})["train"] = points
    for name, layers in per_layer(train).items():
        placed.setdefault(name, {}).update(_layer_lines(layers))
    for name, points in evals.items():
        home = _training_twin(name, train) if name != "loss" else None
        if home is None or home not in placed:  # (an element of a list field has no panel of its own)
            placed[EVAL_PREFIX + name] = {"eval": points}
        else:
            placed[home]["eval"] = points
    return sorted(((group_of(n), n, lines) for n, lines in placed.items()), key=_display_key)


def per_layer(series: dict[str, Series]) -> dict[str, dict[int, Series]]:
    """The per-layer series (``model/layer<i>_<stat>``) by the name of their panel (``model/<stat>``),
    each a dict layer -> points, layers in order."""
    out: dict[str, dict[int, Series]] = {}
    for name, points in series.items():
        match = _PER_LAYER.match(name)
        if match:
            out.setdefault(match["prefix"] + match["stat"], {})[int(match["layer"])] = points
    return {name: dict(sorted(layers.items())) for name, layers in sorted(out.items())}


def _layer_lines(layers: dict[int, Series]) -> dict[str, Series]:
    """A panel's lines for per-layer series: ``layer<i>`` each, up to LIST_ELEMENTS layers; more as
    ``[mean]``, ``[min]`` and ``[max]`` over the layers at each step every layer has."""
    if len(layers) <= LIST_ELEMENTS:
        return {f"layer{i}": points for i, points in layers.items()}
    across = _across_layers(layers)
    return {"[mean]": [(s, math.fsum(v) / len(v)) for s, v in across],
            "[min]": [(s, min(v)) for s, v in across],
            "[max]": [(s, max(v)) for s, v in across]}


def _worst_layer(stat: str, layers: dict[int, Series]) -> Series:
    """One run's line of a per-layer panel in a comparison: the largest value over the layers of a
    ``max`` statistic, the smallest of a ``min`` one, else the mean, at each step every layer has."""
    pick = max if stat.endswith("max") else min if stat.endswith("min") else (lambda v: math.fsum(v) / len(v))
    return [(step, pick(values)) for step, values in _across_layers(layers)]


def _across_layers(layers: dict[int, Series]) -> list[tuple[int, list[float]]]:
    """(step, the layers' values in layer order) at each step every layer has a value for."""
    by_step = [dict(points) for points in layers.values()]
    steps = sorted(set.intersection(*(set(points) for points in by_step)))
    return [(step, [points[step] for points in by_step]) for step in steps]


def plot_run(run_dir: Path, out: Path, *, patterns: Sequence[str] = (), max_panels: int = MAX_PANELS) -> Plot:
    """One run's series as one PNG (and its JSON of the lines drawn): at most ``max_panels``
    panels (0: all) of the series ``patterns`` match (none given: every series)."""
    skipped: list[str] = []
    laid = panels(run_series(run_dir, skipped=skipped))
    return _draw_selected(laid, out, title=run_dir.name, patterns=patterns, max_panels=max_panels, skipped=skipped)


def plot_comparison(run_dirs: list[Path], out: Path, *, patterns: Sequence[str] = (),
                    max_panels: int = MAX_PANELS) -> Plot:
    """Every series of several runs, one line per run, as one PNG (and its JSON); limits as ``plot_run``."""
    skipped: list[str] = []
    by_run = {d.name: _one_line_per_panel(run_series(d, skipped=skipped)) for d in run_dirs}
    names = sorted({n for series in by_run.values() for n in series})
    laid = sorted(((group_of(n), n, {run: series[n] for run, series in by_run.items() if n in series})
                   for n in names), key=_display_key)
    return _draw_selected(laid, out, title="runs: " + ", ".join(by_run), patterns=patterns, max_panels=max_panels,
                          skipped=skipped)


def _one_line_per_panel(series: dict[str, Series]) -> dict[str, Series]:
    """A run's series for a comparison: its per-layer series as one, the worst layer's (``_worst_layer``)."""
    out = {name: points for name, points in series.items() if not _PER_LAYER.match(name)}
    for name, layers in per_layer(series).items():
        out[name] = _worst_layer(name, layers)
    return out


def select_panels(laid: list[tuple[str, str, Any]], *, patterns: Sequence[str], max_panels: int,
                  ) -> tuple[list[tuple[str, str, Any]], list[str]]:
    """(the panels to draw, the names of those left out): the ones a pattern matches (all without
    patterns), the first ``max_panels`` of them in display order (0: no limit)."""
    if max_panels < 0:
        raise UsageError(f"--max-panels must be >= 0, got {max_panels}", hint="0 draws every panel")
    chosen = [p for p in laid if not patterns or any(fnmatch.fnmatchcase(p[1], pattern) for pattern in patterns)]
    if patterns and not chosen:
        names = ", ".join(p[1] for p in laid[:8]) + (f" and {len(laid) - 8} more" if len(laid) > 8 else "")
        raise UsageError(f"--series {' '.join(patterns)} matches no series of this plot",
                         hint=f"its series: {names or 'none'}; patterns are shell-style, e.g. 'loss' or 'objective/*'")
    kept = chosen if max_panels == 0 else chosen[:max_panels]
    return kept, [p[1] for p in laid if p not in kept]


def comparison_path(root: Path, run_dirs: Iterable[Path]) -> Path:
    """Where a comparison goes by default: ``<root>/compare-<8 hex of the run IDs>.png``."""
    digest = hashlib.sha256("\n".join(sorted(d.name for d in run_dirs)).encode()).hexdigest()[:8]
    return root / f"compare-{digest}.png"


def series_path(png: Path) -> Path:
    """The JSON of the lines drawn into ``png``."""
    return png.with_suffix(".json")


# ---------------------------------------------------------------------------- drawing


def _draw_selected(laid, out: Path, *, title: str, patterns: Sequence[str], max_panels: int,
                   skipped: list[str]) -> Plot:
    kept, left_out = select_panels(laid, patterns=patterns, max_panels=max_panels)
    _draw(kept, out, title=title, notes={"left_out": left_out, "skipped_lines": skipped})
    return Plot(out, len(kept), left_out, skipped)


def _draw(laid: list[tuple[str, str, dict[str, Series]]], out: Path, *, title: str,
          notes: dict[str, list[str]]) -> Path:
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
    series_path(out).write_text(json.dumps({"title": title, "panels": drawn, **notes}, indent=1) + "\n")
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


def _records(path: Path, skipped: list[str] | None) -> list[dict[str, Any]]:
    bad: list[tuple[int, str]] = []
    records = list(iter_jsonl(path, skipped=bad))
    _note(path, bad, skipped)
    return records


def _note(path: Path, bad: list[tuple[int, str]], skipped: list[str] | None) -> None:
    if skipped is not None:
        skipped.extend(f"{path} line {number}: {reason}" for number, reason in bad)


def _by_step(records: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for record in records:
        if isinstance(record.get("step"), int):
            out[record["step"]] = record
    return out


def _add_list(out: dict[str, Series], name: str, step: int, value: list) -> None:
    """A list field: each element (up to LIST_ELEMENTS of them), else its mean, min and max."""
    if len(value) <= LIST_ELEMENTS:
        for i, item in enumerate(value):
            _add(out, f"{name}[{i}]", step, item)
        return
    numbers = [float(v) for v in value if _is_number(v)]
    if numbers:
        _add(out, f"{name}[mean]", step, math.fsum(numbers) / len(numbers))
        _add(out, f"{name}[min]", step, min(numbers))
        _add(out, f"{name}[max]", step, max(numbers))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _add(out: dict[str, Series], name: str, step: int, value: Any) -> None:
    if _is_number(value):
        out.setdefault(name, []).append((step, float(value)))
