"""Cross-rank metric aggregation: one collective per log interval, records on rank 0.

``run_dir=None`` (a replay, a benchmark) keeps only the console sink: nothing is written.

Every rank calls ``MetricsTracker.log(step, metrics)`` once per optimizer step with its
own values. Within a log interval each rank averages its values over the steps; at the
end of the interval (``step % metrics.log_interval == 0``, and at ``total_steps``) the
per-rank averages are reduced across ranks in ONE all-reduce: every rank writes its vector
into its own row of a zero ``[world_size, K]`` matrix and the sum of those matrices is the
full per-rank table on every rank, from which mean, min, max, sum and the slowest rank
follow. Rank 0 hands the resulting ``MetricRecord`` to its sinks.

Because ``log`` may run a collective, every rank must call it the same number of times
with the same step and the same metric names (a checksum of the names rides along in the
same collective and a mismatch raises ``MetricsError`` on every rank).

Metric names with a meaning to the tracker:

- ``step_time``: seconds this rank spent in the step; its argmax is ``slowest_rank``.
- ``tokens``: tokens this rank processed in the step (count each token once: under tensor
  parallelism only one rank of a TP group should report them). Their sum over ranks and
  the wall time of the interval give ``tokens_per_s``; with ``flops_per_token`` (training
  FLOPs per token, e.g. 6N plus attention) and ``peak_flops`` (peak FLOP/s of ONE device)
  they give ``mfu = flops_per_token * tokens_per_s / (peak_flops * world_size)``.
- ``loss``, ``lr``: shown on the console line; a method's own fields too, once the trainer
  has told the tracker its console line (``show``).
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

import torch

from core.config import MetricsConfig
from core.exceptions import LockstepError
from experiments.console import ConsoleLine
from experiments.schema import MetricRecord, MetricStats
from experiments.sinks import MetricSink, build_sinks, close_all

log = logging.getLogger(__name__)

STEP_TIME = "step_time"
TOKENS = "tokens"


class MetricsError(LockstepError):
    """Ranks logged different metric names, or a metric value is not a number."""

    kind = "metrics error"


class Collective(Protocol):
    """The part of ``core.distributed_context.DistributedContext`` the tracker uses."""

    rank: int
    world_size: int
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...


class MetricsTracker:
    """Aggregates per-rank step metrics and writes them (rank 0) every log interval."""

    def __init__(
        self,
        config: MetricsConfig,
        *,
        dist: Collective,
        run_dir: Path | None,
        total_steps: int,
        flops_per_token: float | None,
        peak_flops: float | None,
        start_step: int = 0,
        sinks: Sequence[MetricSink] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        print_fn: Callable[[str], None] | None = None,
    ) -> None:
        if config.log_interval < 1:
            raise MetricsError(
                f"metrics.log_interval must be >= 1, got {config.log_interval}",
                key="metrics.log_interval",
            )
        self._config = config
        self._dist = dist
        self._total_steps = total_steps
        self._flops_per_token = flops_per_token
        self._peak_flops = peak_flops
        self._clock = clock
        self._wall_clock = wall_clock
        # Default sinks are built at the first log(): only then is the first step known, so a
        # resumed run purges TensorBoard events after its restored step and its ETA counts from
        # there, although the tracker is built before the checkpoint is restored.
        self._sink_args = None
        if sinks is None and dist.rank == 0:
            self._sink_args = dict(
                run_dir=None if run_dir is None else Path(run_dir),
                total_steps=total_steps,
                print_fn=print_fn or _print_flush,
                start_step=start_step,
            )
        self._sinks: list[MetricSink] = list(sinks or [])
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._interval_steps = 0
        self._interval_start = clock()
        self._last_record: MetricRecord | None = None

    @property
    def last_record(self) -> MetricRecord | None:
        return self._last_record

    def show(self, line: ConsoleLine) -> None:
        """The training method's console line (its loss unit and fields); call before the first
        ``log``, which builds the console sink. Sinks handed to the constructor keep their own."""
        if self._sink_args is not None:
            self._sink_args["console_line"] = line

    def log(self, step: int, metrics: Mapping[str, float]) -> MetricRecord | None:
        """Record this rank's values for ``step``; at an interval end, aggregate (collective).

        Returns the aggregated record (on every rank) at the end of an interval, else None.
        """
        if self._sink_args is not None:
            args, self._sink_args = self._sink_args, None
            args["start_step"] = max(args["start_step"], step - 1)
            self._sinks = build_sinks(self._config, **args)
        for name, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError) as exc:
                raise MetricsError(
                    f"metric {name!r} has a non-numeric value {value!r}", step=step
                ) from exc
            self._sums[name] = self._sums.get(name, 0.0) + number
            self._counts[name] = self._counts.get(name, 0) + 1
        self._interval_steps += 1
        if step % self._config.log_interval == 0 or step >= self._total_steps:
            return self._aggregate(step)
        return None

    def close(self) -> None:
        """Close the sinks. Runs no collective, so it is safe on error paths."""
        self._sink_args = None
        close_all(self._sinks)
        self._sinks = []

    # ------------------------------------------------------------------ internals

    def _aggregate(self, step: int) -> MetricRecord:
        names = sorted(self._sums)
        table = self._gather_table(names, step)
        now = self._clock()
        elapsed = max(now - self._interval_start, 1e-9)
        stats = {
            name: MetricStats(
                mean=float(col.mean()), min=float(col.min()), max=float(col.max()), sum=float(col.sum())
            )
            for name, col in zip(names, table.unbind(dim=1))
        }
        record = MetricRecord(
            step=step,
            time=self._wall_clock(),
            world_size=self._dist.world_size,
            interval_steps=self._interval_steps,
            metrics=stats,
            slowest_rank=(int(table[:, names.index(STEP_TIME)].argmax()) if STEP_TIME in stats else None),
            tokens_per_s=self._tokens_per_s(stats, elapsed),
            eta_s=max(self._total_steps - step, 0) * elapsed / self._interval_steps,
        )
        if record.tokens_per_s is not None and self._flops_per_token and self._peak_flops:
            achieved = self._flops_per_token * record.tokens_per_s
            record = replace(record, mfu=achieved / (self._peak_flops * self._dist.world_size))
        self._write(record)
        self._sums.clear()
        self._counts.clear()
        self._interval_steps = 0
        self._interval_start = now
        self._last_record = record
        return record

    def _gather_table(self, names: list[str], step: int) -> torch.Tensor:
        """[world_size, K] per-rank interval means, via one all-reduce of a padded matrix."""
        checksum = float(zlib.crc32("\0".join(names).encode()))
        row = [self._sums[n] / self._counts[n] for n in names] + [checksum]
        matrix = torch.zeros(self._dist.world_size, len(row), dtype=torch.float64, device=self._dist.device)
        matrix[self._dist.rank] = torch.tensor(row, dtype=torch.float64)
        self._dist.all_reduce(matrix, "sum")
        table = matrix.cpu()
        if not bool((table[:, -1] == checksum).all()):
            raise MetricsError(
                "ranks logged different metric names",
                step=step,
                rank=self._dist.rank,
                hint=f"every rank must log the same names each step; this rank logged {names}",
            )
        return table[:, :-1]

    def _tokens_per_s(self, stats: Mapping[str, MetricStats], elapsed: float) -> float | None:
        tokens = stats.get(TOKENS)
        if tokens is None:
            return None
        return tokens.sum * self._interval_steps / elapsed

    def _write(self, record: MetricRecord) -> None:
        for sink in list(self._sinks):
            try:
                sink.write(record)
            except Exception as exc:
                # Raising here would leave rank 0 out of the next collective and hang the
                # others; a broken sink is reported and dropped instead.
                log.error("metrics sink %s failed and is disabled: %s", type(sink).__name__, exc)
                self._sinks.remove(sink)


def _print_flush(line: str) -> None:
    print(line, flush=True)
