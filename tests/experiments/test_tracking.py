"""experiments/tracking.py and sinks.py: interval aggregation, sinks, and two real ranks."""

import json
import logging
import os
import traceback
from pathlib import Path

import pytest
import torch

from core.config import MetricsConfig
from core.distributed_context import DistributedContext
from experiments.tracking import MetricsError, MetricsTracker
from tests import launch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _single():
    return DistributedContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", timeout_s=10
    )


def _metrics_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_interval_means_throughput_mfu_eta_and_all_sinks(tmp_path):
    clock, printed = Clock(), []
    tracker = MetricsTracker(
        MetricsConfig(log_interval=2),
        dist=_single(),
        run_dir=tmp_path,
        total_steps=5,
        flops_per_token=1e6,
        peak_flops=1e9,
        clock=clock,
        wall_clock=lambda: 1234.0,
        print_fn=printed.append,
    )
    records = []
    for step in range(1, 6):
        clock.now += 2.0  # two seconds per step
        records.append(tracker.log(step, {"loss": 10.0 - step, "tokens": 1000, "step_time": 2.0, "lr": 1e-3}))
    tracker.close()
    assert [r is None for r in records] == [True, False, True, False, False]
    lines = _metrics_lines(tmp_path)
    assert [line["step"] for line in lines] == [2, 4, 5]
    first = lines[0]
    assert first["interval_steps"] == 2 and first["time"] == 1234.0
    assert first["metrics"]["loss"] == {"mean": 8.5, "min": 8.5, "max": 8.5, "sum": 8.5}
    assert first["tokens_per_s"] == pytest.approx(500.0)  # 2000 tokens in 4 s
    assert first["mfu"] == pytest.approx(500.0 * 1e6 / 1e9)
    assert first["eta_s"] == pytest.approx(3 * 2.0)
    assert first["slowest_rank"] == 0
    assert lines[2]["interval_steps"] == 1 and lines[2]["eta_s"] == 0

    assert len(printed) == 3
    assert printed[0].startswith("step 2/5 | loss 8.5000 | lr 1.00e-03 | 500 tok/s | MFU 50.0%")
    assert "ETA 0:00:06" in printed[0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"loss/mean", "loss/max", "tokens/mean", "throughput/tokens_per_s", "throughput/mfu"} <= set(scalars)
    loss = acc.Scalars("loss/mean")
    assert [(e.step, e.value) for e in loss] == [(2, 8.5), (4, 6.5), (5, 5.0)]


def test_tensorboard_off_and_wandb_missing_do_not_break(tmp_path, caplog, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with caplog.at_level(logging.WARNING):
        tracker = MetricsTracker(
            MetricsConfig(tensorboard=False, wandb=True), dist=_single(), run_dir=tmp_path,
            total_steps=2, flops_per_token=None, peak_flops=None, print_fn=lambda line: None,
        )
    tracker.log(1, {"loss": 1.0})
    tracker.close()
    assert "wandb is not installed" in caplog.text
    assert not (tmp_path / "tensorboard").exists()
    assert _metrics_lines(tmp_path)[0]["mfu"] is None and _metrics_lines(tmp_path)[0]["tokens_per_s"] is None


class ExplodingSink:
    def __init__(self):
        self.calls = 0

    def write(self, record):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        pass


def test_without_run_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed = []
    tracker = MetricsTracker(
        MetricsConfig(), dist=_single(), run_dir=None, total_steps=2,
        flops_per_token=None, peak_flops=None, print_fn=printed.append,
    )
    tracker.log(1, {"loss": 1.0})
    tracker.log(2, {"loss": 1.0})
    tracker.close()
    assert len(printed) == 2 and list(tmp_path.iterdir()) == []


def test_a_failing_sink_is_dropped_not_raised(tmp_path):
    sink = ExplodingSink()
    tracker = MetricsTracker(
        MetricsConfig(), dist=_single(), run_dir=tmp_path, total_steps=3,
        flops_per_token=None, peak_flops=None, sinks=[sink],
    )
    for step in (1, 2, 3):
        assert tracker.log(step, {"loss": 1.0}) is not None
    assert sink.calls == 1


def test_non_numeric_metric_is_refused(tmp_path):
    tracker = MetricsTracker(
        MetricsConfig(), dist=_single(), run_dir=tmp_path, total_steps=3,
        flops_per_token=None, peak_flops=None, sinks=[],
    )
    with pytest.raises(MetricsError, match="non-numeric"):
        tracker.log(1, {"loss": "low"})


def test_resumed_run_purges_overlapping_tensorboard_steps(tmp_path):
    def run(start, stop, loss):
        tracker = MetricsTracker(
            MetricsConfig(), dist=_single(), run_dir=tmp_path, total_steps=10, start_step=start,
            flops_per_token=None, peak_flops=None, print_fn=lambda line: None,
        )
        for step in range(start + 1, stop + 1):
            tracker.log(step, {"loss": loss})
        tracker.close()

    run(0, 6, loss=1.0)  # crashed after step 6, last checkpoint at step 4
    run(4, 8, loss=2.0)  # resumed: steps 5 and 6 again
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    values = {e.step: e.value for e in acc.Scalars("loss/mean")}
    assert values == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 2.0, 6: 2.0, 7: 2.0, 8: 2.0}
    assert len(acc.Scalars("loss/mean")) == 8


# ----------------------------------------------------------------------------- two real ranks



def _tracker_worker(rank: int, world: int, port: int, run_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist = DistributedContext(
            rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo", timeout_s=60
        )
        dist.init_process_group()
        calls = []
        real = dist.all_reduce
        dist.all_reduce = lambda t, op="sum": calls.append(op) or real(t, op)  # count collectives
        tracker = MetricsTracker(
            MetricsConfig(log_interval=2), dist=dist, run_dir=Path(run_dir), total_steps=4,
            flops_per_token=None, peak_flops=None, print_fn=lambda line: None,
        )
        records = []
        for step in range(1, 5):
            metrics = {"loss": float(step + 10 * rank), "step_time": 1.0 + rank, "tokens": 100.0}
            records.append(tracker.log(step, metrics))
        tracker.close()
        out = {"collectives": len(calls), "records": [r.to_dict() if r else None for r in records]}
        # Mismatched metric names must fail on every rank, not hang or pass silently.
        bad = MetricsTracker(
            MetricsConfig(), dist=dist, run_dir=Path(run_dir) / "bad", total_steps=1,
            flops_per_token=None, peak_flops=None, sinks=[],
        )
        try:
            bad.log(1, {"loss_a" if rank == 0 else "loss_b": 1.0})
            out["mismatch"] = "not detected"
        except MetricsError as exc:
            out["mismatch"] = str(exc)
        Path(run_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.close()
    except BaseException:
        Path(run_dir, f"rank{rank}_error.txt").write_text(traceback.format_exc())
        raise


def test_two_ranks_one_collective_per_interval_with_mean_min_max_sum_and_slowest(tmp_path):
    r0, r1 = launch.spawn_json_ranks(_tracker_worker, tmp_path)
    assert r0["collectives"] == r1["collectives"] == 2  # 4 steps, interval 2
    for a, b in zip(r0["records"], r1["records"]):  # every rank gets the same aggregate
        assert (a is None) == (b is None)
        assert a is None or (a["metrics"], a["slowest_rank"]) == (b["metrics"], b["slowest_rank"])
    lines = _metrics_lines(tmp_path)  # written once, by rank 0
    assert [line["step"] for line in lines] == [2, 4]
    loss = lines[0]["metrics"]["loss"]  # rank 0: steps 1,2 -> 1.5; rank 1: 11, 12 -> 11.5
    assert loss == {"mean": 6.5, "min": 1.5, "max": 11.5, "sum": 13.0}
    assert lines[0]["metrics"]["step_time"]["max"] == 2.0
    assert lines[0]["slowest_rank"] == 1 and lines[0]["world_size"] == 2
    assert lines[0]["metrics"]["tokens"]["sum"] == 200.0
    assert "different metric names" in r0["mismatch"] and "different metric names" in r1["mismatch"]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
