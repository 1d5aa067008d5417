"""runtime/watchdog.py: timeouts, pauses, the diagnostics bundle, and real hung processes."""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

from core.config import RuntimeConfig
from core.exceptions import ExitCode
from runtime.watchdog import Watchdog, configure_nccl_diagnostics
from tests import launch

ROOT = Path(__file__).resolve().parents[2]


def _watchdog(tmp_path, timeout=0.3, *, providers=None, on_abort=None, codes=None, **config):
    codes = [] if codes is None else codes
    config.setdefault("watchdog_exit_grace_s", 0.0)
    wd = Watchdog(
        RuntimeConfig(watchdog_timeout_s=timeout, **config),
        rank=1,
        diagnostics_dir=tmp_path / "diagnostics",
        providers=providers or {},
        on_abort=on_abort,
        exit_fn=codes.append,
        section_timeout_s=0.5,
        gil_backstop=False,
    )
    return wd, codes


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_no_heartbeat_writes_bundle_calls_on_abort_and_exits_6(tmp_path):
    summaries = []
    providers = {
        "pipeline": lambda: {"queue_depths": [3, 0], "semaphore_free": 12},
        "broken": lambda: 1 / 0,
        "blocked": lambda: time.sleep(30),
        "nan": lambda: float("nan"),
    }
    wd, codes = _watchdog(tmp_path, providers=providers, on_abort=summaries.append)
    wd.start()
    wd.heartbeat(5, "forward")
    assert _wait_for(lambda: codes, timeout=10)
    wd.stop()
    assert codes == [ExitCode.WATCHDOG] and wd.fired

    diag = tmp_path / "diagnostics"
    stacks = (diag / "rank1_stacks.txt").read_text()
    assert "no progress" in stacks
    assert "test_no_heartbeat_writes_bundle" in stacks  # the main thread's frame, from faulthandler
    bundle = json.loads((diag / "rank1_watchdog.json").read_text())
    assert bundle["last_step"] == 5 and bundle["last_phase"] == "forward"
    assert bundle["seconds_since_heartbeat"] >= 0.3
    assert bundle["memory"]["value"]["rss_bytes"] > 0
    assert bundle["providers"]["pipeline"] == {"value": {"queue_depths": [3, 0], "semaphore_free": 12}}
    assert "ZeroDivisionError" in bundle["providers"]["broken"]["error"]
    assert "did not return" in bundle["providers"]["blocked"]["error"]
    assert bundle["providers"]["nan"] == {"value": None}
    assert any("MainThread" in name for name in bundle["threads"])

    (summary,) = summaries
    assert summary["step"] == 5 and summary["phase"] == "forward"
    assert not {"rank", "time", "event"} & set(summary)  # safe to splat into an event record
    assert summary["error"]["exit_code"] == ExitCode.WATCHDOG
    assert str(diag / "rank1_stacks.txt") in summary["files"]


def test_heartbeats_keep_it_quiet(tmp_path):
    wd, codes = _watchdog(tmp_path, timeout=0.25)
    wd.start()
    for step in range(15):
        wd.heartbeat(step, "forward")
        time.sleep(0.05)
    wd.stop()
    assert codes == [] and not (tmp_path / "diagnostics").exists()


def test_pause_suspends_the_timeout_and_resume_restarts_it(tmp_path):
    wd, codes = _watchdog(tmp_path, timeout=0.25)
    wd.start()
    wd.heartbeat(3, "checkpoint")
    with wd.pause():
        with wd.pause():  # nested pauses
            time.sleep(0.4)
        time.sleep(0.2)
        assert codes == []
    time.sleep(0.1)  # timeout counts from the resume, not from the last heartbeat
    assert codes == []
    assert _wait_for(lambda: codes, timeout=3)
    wd.stop()


def test_pause_longer_than_the_limit_aborts(tmp_path):
    wd, codes = _watchdog(tmp_path, timeout=5.0, watchdog_pause_limit_s=0.3)
    wd.start()
    wd.heartbeat(7, "checkpoint")
    wd.pause()
    assert _wait_for(lambda: codes, timeout=5)
    wd.stop()
    bundle = json.loads((tmp_path / "diagnostics" / "rank1_watchdog.json").read_text())
    assert "watchdog_pause_limit_s" in bundle["reason"] and bundle["paused"] is True


def test_disabled_with_timeout_zero_and_stop_prevents_firing(tmp_path):
    wd, codes = _watchdog(tmp_path, timeout=0.0)
    assert not wd.enabled
    wd.start()
    time.sleep(0.2)
    assert codes == []
    wd2, codes2 = _watchdog(tmp_path, timeout=0.3)
    wd2.start()
    wd2.stop()
    time.sleep(0.5)
    assert codes2 == []


def test_configure_nccl_diagnostics_sets_defaults_but_keeps_operator_values(tmp_path):
    env = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    out = configure_nccl_diagnostics(tmp_path / "diag", 300, environ=env)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the operator's value wins
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"  # torch 2.13 reads the TORCH_FR_* names
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # deprecated name: torch warns about it
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "300"
    prefix = Path(env["TORCH_FR_DUMP_TEMP_FILE"])
    assert prefix.parent == (tmp_path / "diag").resolve() and prefix.parent.is_dir()
    assert out == {k: env[k] for k in out}


# ----------------------------------------------------------------------------- real processes



def _hang_worker(rank: int, world: int, port: int, run_dir: str) -> None:
    """Rank 1 hangs at step 2 (fault), rank 0 blocks in the step's all-reduce."""
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
        )
        import torch

        from core.distributed_context import DistributedContext
        from experiments.events import EventLog
        from runtime.faults import FaultInjector, parse_faults
        from runtime.health import StallDetector
        from runtime.profiler import StepTimer
        from runtime.watchdog import configure_nccl_diagnostics

        diag = Path(run_dir) / "diagnostics"
        configure_nccl_diagnostics(diag, 60)  # before the process group: flight recorder on
        dist = DistributedContext(
            rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
            backend="gloo", timeout_s=120,
        )
        dist.init_process_group()
        events = EventLog(Path(run_dir) / "events.jsonl", rank=rank)
        stall = StallDetector()
        watchdog = Watchdog(
            # Both ranks stop heartbeating within milliseconds of each other and fire within a
            # poll (0.1 s): 3 s of grace keep the hung rank up until its peer has dumped.
            RuntimeConfig(watchdog_timeout_s=1.0, watchdog_exit_grace_s=3.0),
            rank=rank,
            diagnostics_dir=diag,
            providers={"stall": stall.summary, "pipeline": lambda: {"queue_depth": 4}},
            on_abort=lambda s: events.emit("watchdog_abort", step=s["step"], phase=s["phase"]),
        )
        faults = FaultInjector(parse_faults(["hang@2:1"]), rank=rank)
        timer = StepTimer(device="cpu", listeners=[watchdog, stall])
        watchdog.start()
        for step in range(1, 5):
            timer.start_step(step)
            faults.before_step(step)
            with timer.phase("communication"):
                dist.all_reduce(torch.ones(4))
            stall.observe(step, timer.end_step())
        os._exit(0)  # not reached: the watchdog ends both ranks
    except BaseException:
        if "watchdog" in locals() and watchdog.fired:
            # The peer's exit failed our blocked collective after our watchdog fired: the
            # abort is still the watchdog's (train.py maps this case to exit 6 too).
            watchdog.wait_for_dump(timeout=30)
            os._exit(ExitCode.WATCHDOG)
        Path(run_dir, f"rank{rank}_error.txt").write_text(traceback.format_exc())
        os._exit(99)


def test_two_ranks_one_hung_both_dump_and_exit_6(tmp_path):
    port = launch.free_port()
    codes = launch.spawn_ranks(_hang_worker, lambda r: (r, 2, port, str(tmp_path)), timeout=90)
    errors = [f.read_text() for f in tmp_path.glob("rank*_error.txt")]
    assert codes == [ExitCode.WATCHDOG, ExitCode.WATCHDOG], (codes, errors)

    diag = tmp_path / "diagnostics"
    stacks0 = (diag / "rank0_stacks.txt").read_text()
    stacks1 = (diag / "rank1_stacks.txt").read_text()
    assert "all_reduce" in stacks0  # blocked in the collective, dumped while inside C code
    assert "maybe_hang" in stacks1  # the hung rank's own stack names the culprit
    for rank, phase in ((0, "communication"), (1, "step_start")):
        bundle = json.loads((diag / f"rank{rank}_watchdog.json").read_text())
        assert bundle["last_step"] == 2 and bundle["last_phase"] == phase
        assert bundle["providers"]["pipeline"]["value"] == {"queue_depth": 4}
        assert bundle["providers"]["stall"]["value"]["current"]["step"] == 2
    assert json.loads((diag / "rank0_watchdog.json").read_text())["providers"]["stall"]["value"][
        "stalled_on"
    ] == "compute"

    # The flight recorder shows rank 0's all-reduce of step 2 as enqueued, not completed. Where the
    # file is missing, the bundle's section says why (its error, or no entries).
    recorder = diag / "rank0_flight_recorder.pkl"
    assert recorder.exists(), json.loads((diag / "rank0_watchdog.json").read_text())["flight_recorder"]
    trace = pickle.loads(recorder.read_bytes())
    reduces = [e for e in trace["entries"] if "all_reduce" in e["profiling_name"]]
    assert [e["retired"] for e in reduces] == [True, False]
    assert trace["pg_status"]["0"]["last_enqueued_collective"] == 2
    assert trace["pg_status"]["0"]["last_completed_collective"] == 1

    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sorted((e["event"], e["rank"], e["step"]) for e in events) == [
        ("watchdog_abort", 0, 2),
        ("watchdog_abort", 1, 2),
    ]


def test_gil_backstop_dumps_and_exits_when_python_threads_cannot_run(tmp_path):
    # A catastrophic regex holds the GIL in C for minutes: the Python watchdog thread never
    # runs again, so only the faulthandler backstop (a C thread) can end the process.
    script = textwrap.dedent(
        f"""
        import re, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from core.config import RuntimeConfig
        from runtime.watchdog import Watchdog
        wd = Watchdog(RuntimeConfig(watchdog_timeout_s=0.5, watchdog_exit_grace_s=0), rank=0,
                      diagnostics_dir=Path({str(tmp_path)!r}), providers={{}}, on_abort=None,
                      backstop_margin_s=1.0)
        wd.start()
        re.match(r"(a+)+$", "a" * 40 + "b")
        """
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 60
    assert "Timeout" in proc.stderr and "<module>" in proc.stderr
