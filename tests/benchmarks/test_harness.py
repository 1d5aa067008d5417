"""The benchmark harnesses end a job whole: torchrun and every rank.

torchrun starts each rank in a session of its own, so killing torchrun's process group
leaves the ranks running; a harness reading the job's pipes then waits for ever. These jobs
run a script (not train.py, whose ranks follow their launcher by themselves) that ignores
SIGTERM and never ends.
"""

from __future__ import annotations

import functools
import importlib.util
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

HANG = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
    print("rank", os.environ["RANK"], "hangs", flush=True)
    while True:
        time.sleep(1)
    """
)


def _module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _job(tmp_path: Path) -> list[str]:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)]


def _ranks(tmp_path: Path) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = [int(p.read_text()) for p in tmp_path.glob("[0-9]") if p.read_text()]
        if len(pids) == 2:
            return pids
        time.sleep(0.1)
    raise AssertionError("the ranks did not start")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_throughput_launch_times_out_and_ends_every_rank(tmp_path, monkeypatch):
    tt = _module("train_throughput")
    # The ranks ignore SIGTERM: kill_job must escalate to SIGKILL; 3 s of SIGTERM grace
    # instead of the default 20 make that happen sooner, through the same path.
    monkeypatch.setattr(tt, "kill_job", functools.partial(
        tt.kill_job, escalation=((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0))))
    # Long enough for torchrun and both ranks to start on a loaded 2-core machine (5 s failed
    # once with three test workers: torchrun's own start had not reached the ranks).
    timeout = 20
    started = time.monotonic()
    result = tt.launch(_job(tmp_path), timeout=timeout)
    assert result.timed_out
    assert "hangs" in result.stdout
    assert time.monotonic() - started < timeout + 3 + 10 + 15  # timeout, SIGTERM grace, SIGKILL grace, slack
    assert not [pid for pid in _ranks(tmp_path) if _alive(pid)]


def test_determinism_kill_job_ends_every_rank(tmp_path):
    det = _module("gpu_determinism")
    proc = subprocess.Popen(_job(tmp_path), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ranks = _ranks(tmp_path)
    started = time.monotonic()
    det.kill_job(proc)
    assert time.monotonic() - started < 10
    assert not [pid for pid in ranks if _alive(pid)]


def test_determinism_benchmark_passes_its_checks_on_cpu_ranks(e2e_workdir, tmp_path, monkeypatch, capsys):
    """benchmarks/gpu_determinism.py end to end on 2 gloo ranks (the GPU runs' evidence comes
    from this script): two fresh runs, SIGKILL and resume, replay, and the first checkpoint
    resumed on one rank, all passing, with the JSON saying so. Its ``main`` runs here and starts
    each job as tests/launch.py does (ranks forked from the zygote's import, not torchrun's fresh
    interpreters: about 40 CPU-s less); ending a torchrun job whole is the test above."""
    import json

    from tests import launch

    det = _module("gpu_determinism")

    def start(gpus: int, train_args: list[str], log: Path):
        with log.open("a") as handle:
            return launch.popen(launch.command(gpus, train_args), det.WORKDIR, launch.env(det.WORKDIR),
                                output=handle.fileno())

    monkeypatch.setattr(det, "start", start)
    out = tmp_path / "det.json"
    config = ROOT / "tests" / "configs" / "e2e.yaml"
    code = det.main(["--config", str(config), "--gpus", "2", "--resume-on", "1", "--seq", "64", "--global-batch", "4",
                     "--steps", "7", "--interval", "3", "--workdir", str(e2e_workdir),
                     "--run-root", str(tmp_path / "runs"), "--out", str(out)])
    assert code == 0, capsys.readouterr().out[-3000:] + (tmp_path / "runs" / "g2" / "train.log").read_text()[-3000:]
    results = json.loads(out.read_text())
    assert results["env"]["torch"] == torch.__version__ and results["env"]["cpu_model"]  # which machine
    case = results["cases"]["2gpu"]
    assert set(case) == {"repeat", "kill_resume", "replay", "resume_on_1gpu"}
    assert all(check["ok"] for check in case.values()), case
    assert case["repeat"]["lines"] == 7 and case["replay"]["step"] == 7
    assert case["kill_resume"]["latest_at_kill"].startswith("step_")  # killed after an intact checkpoint
    assert case["resume_on_1gpu"]["same_batches"] and case["resume_on_1gpu"]["lines"] == 7


def test_determinism_benchmark_tells_other_batches_apart():
    det = _module("gpu_determinism")
    ref = [{"step": s, "batch_hash": f"b{s}", "data_state_hash": f"d{s}", "loss": 1.0} for s in (1, 2, 3)]
    assert det.same_data(ref, [dict(r, loss=1.1) for r in ref])  # losses may differ across GPU counts
    assert not det.same_data(ref, ref[:2])
    assert not det.same_data(ref, [*ref[:2], dict(ref[2], batch_hash="other")])
    assert not det.same_data(ref, [*ref[:2], dict(ref[2], data_state_hash="other")])


def test_determinism_benchmark_checks_sampled_batches_at_the_first_resumed_step_only():
    """A GRPO/PPO batch comes from the weights: after the first resumed step they were updated
    with another reduction order, so only that step's batch must match; data batches all must."""
    det = _module("gpu_determinism")
    ref = [{"step": s, "batch_hash": f"b{s}", "rollout_hash": f"r{s}", "data_state_hash": f"d{s}", "loss": 1.0}
           for s in (1, 2, 3, 4)]
    later_differs = [*ref[:3], dict(ref[3], batch_hash="x", rollout_hash="y")]
    sampled = det.resume_verdict(ref, later_differs, sampled=True, resumed_at=2)
    assert sampled["ok"] and sampled["checked_steps"] == 3 and not sampled["all_steps_same_batches"]
    assert sampled["first_difference"] == "step 4: batch_hash"
    assert not det.resume_verdict(ref, later_differs, sampled=False, resumed_at=2)["ok"]
    first_differs = [*ref[:2], dict(ref[2], rollout_hash="y"), ref[3]]
    assert det.resume_verdict(ref, first_differs, sampled=True, resumed_at=2)["first_difference"] == "step 3: rollout_hash"
    assert not det.resume_verdict(ref, [*ref[:2], dict(ref[2], batch_hash="x"), ref[3]], sampled=True,
                                  resumed_at=2)["ok"]
    assert not det.resume_verdict(ref, [*ref[:3], dict(ref[3], data_state_hash="x")], sampled=True,
                                  resumed_at=2)["ok"]  # the data position always
    assert not det.resume_verdict(ref, ref[:3], sampled=True, resumed_at=2)["ok"]


def test_determinism_benchmark_compares_gpu_counts_by_their_batches():
    det = _module("gpu_determinism")
    one = [{"step": s, "batch_hash": f"b{s}", "data_state_hash": f"d{s}", "loss": 2.0} for s in (1, 2)]
    two = [dict(r, loss=2.002) for r in one]
    cross = det.across_world_sizes({1: one, 2: two})["1v2"]
    assert cross["same_batches"] and cross["max_rel_loss_diff"] == pytest.approx(1e-3)
    assert not det.across_world_sizes({1: one, 2: [two[0], dict(two[1], batch_hash="x")]})["1v2"]["same_batches"]


def test_determinism_benchmark_ppo_method_is_a_valid_ppo_config_that_overrides_still_change(tmp_path):
    """``--method ppo`` adds PPO's settings (METHODS) before ``--override``, and the result loads as PPO."""
    from argparse import Namespace

    from core.config import load
    from training.objectives import check_objective_config

    det = _module("gpu_determinism")
    args = Namespace(config=str(ROOT / "tests" / "configs" / "e2e.yaml"), global_batch=4, seq=112, steps=5, interval=2,
                     method="ppo", override=["parallel.device=cpu", "objective.ppo.kl_coef=0.1"])
    flags = det.overrides(args, 1, tmp_path)
    assert flags[:2] == ["--config", args.config]
    config = load(flags[1], flags[2:])
    check_objective_config(config)  # the rewards resolve, the critic's source exists
    ppo = config.objective.ppo
    assert config.objective.kind == "ppo" and ppo.ppo_epochs == 2 and ppo.minibatches == 2
    assert [r.name for r in ppo.rewards] == ["exact_answer", "format_regex"]
    assert ppo.kl_coef == 0.1 and config.parallel.device == "cpu"  # --override wins over the method's settings
    assert det.METHODS["lm"] == () and det.overrides(Namespace(**{**vars(args), "method": "lm"}), 1, tmp_path)[-2:] \
        == args.override
