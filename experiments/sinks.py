"""Where aggregated metric records go: metrics.jsonl, TensorBoard, the console, W&B.

Only rank 0 builds sinks (``build_sinks``). Each sink implements ``MetricSink``.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from core.config import MetricsConfig
from core import layout
from experiments.console import ConsoleLine, format_fields
from experiments.events import append_line
from experiments.schema import MetricRecord

MODEL_AUX_PREFIX = "model/aux/"
"""The metrics of a model's auxiliary losses (training.step.AUX_PREFIX), shown on the step line."""
LAYER_STAT = re.compile(r"model/layer\d+_(load|bias)_(min|max)")
"""A mixture of experts' per-layer balance (models/qwen3_moe/model.py): the least and most loaded
expert's tokens over the even share, the balancing bias's range."""

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    """Receives every aggregated record on rank 0."""

    def write(self, record: MetricRecord) -> None: ...

    def close(self) -> None: ...


class JsonlMetricsSink:
    """Appends one line per record to ``metrics.jsonl``.

    A resumed run first drops the records after its restored step (``keep_through``), as the
    ledger does, so every step appears once.
    """

    def __init__(self, path: Path, *, keep_through: int | None = None) -> None:
        self._path = Path(path)
        if keep_through is not None and self._path.is_file():
            _truncate_after(self._path, keep_through)

    def write(self, record: MetricRecord) -> None:
        append_line(self._path, record.to_json(), fsync=False)

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars ``<metric>/mean|min|max`` and ``throughput/*`` under ``run_dir/tensorboard``.

    ``purge_step`` (the first step of a resumed run) makes TensorBoard drop events that the
    interrupted run wrote at or after that step, so a resumed curve has no overlap.
    """

    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, record: MetricRecord) -> None:
        step = record.step
        for name, stats in record.metrics.items():
            self._writer.add_scalar(f"{name}/mean", stats.mean, step)
            self._writer.add_scalar(f"{name}/min", stats.min, step)
            self._writer.add_scalar(f"{name}/max", stats.max, step)
        for name in ("tokens_per_s", "mfu"):
            value = getattr(record, name)
            if value is not None:
                self._writer.add_scalar(f"throughput/{name}", value, step)
        if record.slowest_rank is not None:
            self._writer.add_scalar("ranks/slowest_rank", record.slowest_rank, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class ConsoleSink:
    """One progress line per record: step, loss (with the method's unit and fields: ``line``),
    LR, tokens/s, MFU, ETA, slowest rank."""

    def __init__(self, *, total_steps: int, print_fn: Callable[[str], None], line: ConsoleLine | None = None) -> None:
        self._total_steps = total_steps
        self._print = print_fn
        self._line = line

    def write(self, record: MetricRecord) -> None:
        self._print(format_progress(record, self._total_steps, self._line))

    def close(self) -> None:
        pass


class WandbSink:
    """Weights & Biases run named after the run ID (resumes the same W&B run)."""

    def __init__(self, *, project: str, run_dir: Path) -> None:
        import wandb  # optional dependency, checked by build_sinks

        self._run = wandb.init(
            project=project, name=run_dir.name, id=run_dir.name, dir=str(run_dir), resume="allow"
        )

    def write(self, record: MetricRecord) -> None:
        data: dict[str, Any] = {f"{k}/mean": v.mean for k, v in record.metrics.items()}
        data.update({f"{k}/max": v.max for k, v in record.metrics.items()})
        for name in ("tokens_per_s", "mfu"):
            if getattr(record, name) is not None:
                data[f"throughput/{name}"] = getattr(record, name)
        self._run.log(data, step=record.step)

    def close(self) -> None:
        self._run.finish()


def build_sinks(
    config: MetricsConfig,
    *,
    run_dir: Path | None,
    total_steps: int,
    start_step: int,
    print_fn: Callable[[str], None],
    console_line: ConsoleLine | None = None,
) -> list[MetricSink]:
    """The sinks ``config`` asks for (call on rank 0 only); without a run dir, console only."""
    if run_dir is None:
        return [ConsoleSink(total_steps=total_steps, print_fn=print_fn, line=console_line)]
    keep = start_step if start_step > 0 else None
    sinks: list[MetricSink] = [JsonlMetricsSink(run_dir / layout.METRICS_FILE, keep_through=keep)]
    if config.tensorboard:
        purge = start_step + 1 if start_step > 0 else None
        sinks.append(TensorBoardSink(run_dir / layout.TENSORBOARD_DIR, purge_step=purge))
    if config.wandb:
        if importlib.util.find_spec("wandb") is None:
            log.warning("metrics.wandb is on but wandb is not installed; W&B logging is off")
        else:
            sinks.append(WandbSink(project=config.wandb_project, run_dir=run_dir))
    sinks.append(ConsoleSink(total_steps=total_steps, print_fn=print_fn, line=console_line))
    return sinks


def expert_balance(record: MetricRecord) -> list[str]:
    """A mixture of experts' balance on the step line, over every sparse layer: ``load 0.62-1.41`` (the
    least and the most loaded expert of any layer, in tokens over the even share) and, with the
    balancing bias, ``bias -1.2e-03..3.4e-03``; nothing for a dense model."""
    found: dict[tuple[str, str], list[float]] = {}
    for name, stats in record.metrics.items():
        match = LAYER_STAT.fullmatch(name)
        if match:
            found.setdefault(match.groups(), []).append(stats.mean)
    parts = []
    if ("load", "min") in found and ("load", "max") in found:
        parts.append(f"load {min(found['load', 'min']):.2f}-{max(found['load', 'max']):.2f}")
    if ("bias", "min") in found and ("bias", "max") in found:
        parts.append(f"bias {min(found['bias', 'min']):.1e}..{max(found['bias', 'max']):.1e}")
    return parts


def format_progress(record: MetricRecord, total_steps: int, line: ConsoleLine | None = None) -> str:
    """``step 3/10 | loss 0.6931 per pair | accuracy 0.6250 | ... | lr 1.00e-03 | 500 tok/s | ...``:
    without ``line`` (a method's console line), the loss alone, without a unit."""
    parts = [f"step {record.step}/{total_steps}"]
    if line is None:
        loss = record.metrics.get("loss")
        if loss is not None:
            parts.append(f"loss {loss.mean:.4f}")
    else:
        parts += format_fields({name: stats.mean for name, stats in record.metrics.items()}, line)
    # The model's auxiliary losses (a router's balance loss), where the model adds any: training/step.py.
    parts += [f"aux {name.removeprefix(MODEL_AUX_PREFIX)} {stats.mean:.4f}"
              for name, stats in sorted(record.metrics.items()) if name.startswith(MODEL_AUX_PREFIX)]
    parts += expert_balance(record)
    lr = record.metrics.get("lr")
    if lr is not None:
        parts.append(f"lr {lr.mean:.2e}")
    if record.tokens_per_s is not None:
        parts.append(f"{record.tokens_per_s:,.0f} tok/s")
    if record.mfu is not None:
        parts.append(f"MFU {100 * record.mfu:.1f}%")
    if record.eta_s is not None:
        parts.append(f"ETA {datetime.timedelta(seconds=round(record.eta_s))}")
    step_time = record.metrics.get("step_time")
    if record.slowest_rank is not None and step_time is not None and record.world_size > 1:
        parts.append(f"slowest rank {record.slowest_rank} ({step_time.max:.3f}s)")
    return " | ".join(parts)


def close_all(sinks: Sequence[MetricSink]) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # closing one sink must not keep the others open
            log.warning("closing metrics sink %s failed: %s", type(sink).__name__, exc)


def _truncate_after(path: Path, step: int) -> None:
    """Keep the records with ``step <= step`` (and drop a torn last line); atomic replace."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            break
        if int(record.get("step", 0)) <= step:
            kept.append(line + "\n")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
