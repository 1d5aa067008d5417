"""runtime/health.py: stall classification, non-finite agreement across ranks, provenance."""

import dataclasses
import json
import os
import signal
import traceback
from pathlib import Path

import pytest
import torch

from core.distributed_context import DistributedContext
from core.exceptions import CheckpointError, ConfigError, ExitCode, NonFiniteError
from runtime.health import NonFiniteGuard, StallDetector, dump_provenance, provenance_path
from tests import launch


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _single():
    return DistributedContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", timeout_s=10
    )


# ----------------------------------------------------------------------------- StallDetector


def test_stall_in_data_wait_is_reported_as_data_starvation():
    clock = Clock()
    stall = StallDetector(clock=clock)
    assert stall.summary()["verdict"] == "no step started yet"
    stall.on_phase(4, "forward")
    clock.now = 1.0
    stall.on_phase(5, "data_wait")
    clock.now = 31.0
    summary = stall.summary()
    assert stall.stalled_on() == "data"
    assert summary["current"] == {"step": 5, "phase": "data_wait", "kind": "data", "seconds_in_phase": 30.0}
    assert summary["verdict"].startswith("data starvation")


@pytest.mark.parametrize(
    "phase, kind", [("backward", "compute"), ("communication", "compute"), ("checkpoint", "checkpoint"), ("step_end", "between_phases")]
)
def test_stall_kind_follows_the_current_phase(phase, kind):
    stall = StallDetector(clock=Clock())
    stall.on_phase(1, phase)
    assert stall.stalled_on() == kind


def test_bottleneck_from_recent_step_split():
    stall = StallDetector(window=3)
    assert stall.bottleneck() is None
    for step in range(3):
        stall.observe(step, {"data_wait": 0.8, "forward": 0.1, "backward": 0.1})
    assert stall.bottleneck() == "data"
    assert stall.summary()["data_fraction"] == pytest.approx(0.8)
    for step in range(3, 6):  # the window forgets the data-bound steps
        stall.observe(step, {"data_wait": 0.05, "forward": 0.5, "backward": 0.45})
    assert stall.bottleneck() == "compute"
    assert stall.summary()["data_wait_s_mean"] == pytest.approx(0.05)


# ----------------------------------------------------------------------------- NonFiniteGuard


@pytest.mark.parametrize(
    "loss, grad_norm, ok",
    [
        (1.5, 0.3, True),
        (torch.tensor(1.5), torch.tensor(0.3), True),
        (float("nan"), 0.3, False),
        (torch.tensor(1.5), torch.tensor(float("inf")), False),
        (torch.tensor(float("-inf")), None, False),
        (2.0, None, True),
    ],
)
def test_check_single_rank(loss, grad_norm, ok):
    guard = NonFiniteGuard("skip", dist=_single())
    assert guard.check(loss, grad_norm) is ok
    assert guard.skipped == (0 if ok else 1)
    assert guard.last_bad_ranks == (() if ok else (0,))


def test_abort_policy_does_not_count_skips_and_builds_exit_7_error(tmp_path):
    guard = NonFiniteGuard("abort", dist=_single())
    assert guard.check(float("nan"), 1.0) is False
    assert guard.skipped == 0
    path = provenance_path(tmp_path, step=3, rank=0)
    err = guard.error(3, provenance_path=path)
    assert isinstance(err, NonFiniteError) and err.exit_code == ExitCode.NONFINITE == 7
    assert err.context["step"] == 3 and err.context["file"] == str(path)
    assert "step 3" in str(err) and "rank(s) 0" in str(err)


def test_guard_state_round_trip_and_refusal():
    guard = NonFiniteGuard("skip", dist=_single())
    guard.check(float("nan"), 0.0)
    guard.check(float("nan"), 0.0)
    fresh = NonFiniteGuard("skip", dist=_single())
    fresh.load_state_dict(guard.state_dict())
    assert fresh.skipped == 2
    with pytest.raises(CheckpointError, match="version"):
        fresh.load_state_dict({"version": 99, "skipped": 1})


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        NonFiniteGuard("ignore", dist=_single())
    assert info.value.context["key"] == "runtime.on_nonfinite"


@dataclasses.dataclass
class Doc:
    source: str
    shard: int
    record: int
    span: tuple


def test_dump_provenance_writes_strict_json_atomically(tmp_path):
    provenance = {"docs": [Doc("web", 3, 17, (0, 128))], "tokens": torch.tensor([1, 2]), "x": float("nan")}
    path = dump_provenance(tmp_path / "diag" / "p.json", step=9, rank=1, provenance=provenance)
    record = json.loads(path.read_text())  # strict: no NaN literal
    assert record["step"] == 9 and record["rank"] == 1 and record["schema_version"] == 1
    assert record["provenance"]["docs"] == [{"source": "web", "shard": 3, "record": 17, "span": [0, 128]}]
    assert record["provenance"]["tokens"] == [1, 2] and record["provenance"]["x"] is None
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]


# ----------------------------------------------------------------------------- two real ranks



def _agreement_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Only rank 1 sees a NaN / gets SIGTERM; both must take the same decisions."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        from runtime.signals import StopSignals

        dist = DistributedContext(
            rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo", timeout_s=60
        )
        dist.init_process_group()
        guard = NonFiniteGuard("skip", dist=dist)
        loss = torch.tensor(float("nan") if rank == 1 else 2.0)
        result = {
            "finite_step": guard.check(torch.tensor(1.0), torch.tensor(0.5)),
            "nan_on_rank1": guard.check(loss, torch.tensor(0.5)),
            "bad_ranks": list(guard.last_bad_ranks),
            "skipped": guard.skipped,
        }
        with StopSignals() as stop:
            result["stop_before"] = stop.should_stop(dist)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            result["stop_after"] = stop.should_stop(dist)
            result["signal"] = stop.signal_name
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.close()
    except BaseException:
        Path(out_dir, f"rank{rank}_error.txt").write_text(traceback.format_exc())
        raise


def test_two_ranks_agree_on_nonfinite_and_stop(tmp_path):
    r0, r1 = launch.spawn_json_ranks(_agreement_worker, tmp_path)
    for r in (r0, r1):
        assert r["finite_step"] is True
        assert r["nan_on_rank1"] is False  # rank 0's own loss was finite, it still skips
        assert r["bad_ranks"] == [1] and r["skipped"] == 1
        assert r["stop_before"] is False and r["stop_after"] is True
    assert (r0["signal"], r1["signal"]) == (None, "SIGTERM")
