"""runtime/faults.py: the fault grammar, and that each fault fires where and when it should."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from core.exceptions import ConfigError, ExitCode
from runtime.faults import FaultInjector, FaultSpec, for_replay, parse_fault, parse_faults
from runtime.signals import StopSignals

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "entry, expected",
    [
        ("hang@5:1", ("hang", 5, 1)),
        ("nan@3", ("nan", 3, None)),
        ("crash@7:0", ("crash", 7, 0)),
        ("crash_checkpoint@4:1", ("crash_checkpoint", 4, 1)),
        ("sigterm@6", ("sigterm", 6, None)),
        ("slow_data@2", ("slow_data", 2, None)),
        ("slow_data", ("slow_data", None, None)),
        ("logprob_drift@2:1", ("logprob_drift", 2, 1)),
        ("hang@step=5,rank=1", ("hang", 5, 1)),
        ("sigterm@step=4", ("sigterm", 4, None)),
        (" nan@ 3 ", ("nan", 3, None)),
    ],
)
def test_parse_accepts_documented_forms(entry, expected):
    spec = parse_fault(entry)
    assert (spec.kind, spec.step, spec.rank) == expected


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ("hang", "needs a step"),
        ("logprob_drift", "needs a step"),
        ("boom@3", "unknown fault kind 'boom'"),
        ("hnag@5", "did you mean 'hang'"),
        ("hang@x", "cannot read"),
        ("hang@5:1:2", "cannot read"),
        ("hang@-1", ">= 0"),
        ("nan@step=3,step=4", "cannot read"),
        ("hang@rank=1", "needs a step"),
        ("@5", "expected kind@step"),
    ],
)
def test_parse_rejects_bad_entries_naming_entry_and_key(entry, fragment):
    with pytest.raises(ConfigError) as info:
        parse_faults(["nan@1", entry])
    err = info.value
    assert err.exit_code == ExitCode.CONFIG
    assert fragment in str(err)
    assert repr(entry) in err.message
    assert err.context["key"] == "runtime.faults[1]"


def test_fault_fires_once_on_its_step_and_rank_only():
    faults = parse_faults(["slow_data@2:1", "slow_data@4"])
    rank1 = FaultInjector(faults, rank=1, slow_data_s=0.25)
    rank0 = FaultInjector(faults, rank=0, slow_data_s=0.25)
    assert [rank1.slow_data_delay(s) for s in (1, 2, 2, 3, 4, 4)] == [0, 0.25, 0, 0, 0.25, 0]
    assert [rank0.slow_data_delay(s) for s in (1, 2, 3, 4)] == [0, 0, 0, 0.25]


def test_logprob_drift_moves_one_comparison_on_its_step_and_rank():
    faults = parse_faults(["logprob_drift@2:1"])
    rank1, rank0 = FaultInjector(faults, rank=1), FaultInjector(faults, rank=0)
    assert [rank1.drift_logprob(s) for s in (1, 2, 2, 3)] == [False, True, False, False]  # the first compared micro-batch
    assert [rank0.drift_logprob(s) for s in (1, 2, 3)] == [False, False, False]


def test_stepless_slow_data_applies_every_step():
    inj = FaultInjector(parse_faults(["slow_data"]), rank=3, slow_data_s=1.5)
    assert [inj.slow_data_delay(s) for s in (1, 1, 2)] == [1.5, 1.5, 1.5]


def test_poison_loss_makes_loss_and_gradients_nan():
    inj = FaultInjector(parse_faults(["nan@3"]), rank=0)
    w = torch.tensor(2.0, requires_grad=True)
    assert inj.poison_loss(2, w * 3).item() == 6.0
    loss = inj.poison_loss(3, w * 3)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.isnan(w.grad)
    assert inj.poison_loss(3, 1.0) == 1.0  # already fired in this process
    assert FaultInjector(parse_faults(["nan@3"]), rank=0).poison_loss(3, 1.0) != 1.0


def test_a_replay_fires_only_the_faults_that_change_what_the_step_computes():
    faults = parse_faults(["crash@4:1", "nan@3", "slow_data", "sigterm@2", "hang@5", "crash_checkpoint@6", "nan@7:0"])
    assert [f.entry for f in for_replay(faults)] == ["nan@3", "nan@7:0"]
    assert for_replay(parse_faults(["slow_data@5"])) == ()


class _Hung(Exception):
    pass


def test_hang_sleeps_forever_at_its_step():
    calls = []

    def sleep(seconds):
        calls.append(seconds)
        if len(calls) == 3:
            raise _Hung

    inj = FaultInjector(parse_faults(["hang@5:1"]), rank=1, sleep=sleep)
    inj.before_step(4)
    assert calls == []
    with pytest.raises(_Hung):
        inj.before_step(5)
    assert calls == [3600.0] * 3
    FaultInjector(parse_faults(["hang@5:1"]), rank=0, sleep=sleep).maybe_hang(5)  # other rank
    assert len(calls) == 3


def test_sigterm_fault_delivers_a_real_signal_to_the_stop_handler():
    inj = FaultInjector(parse_faults(["sigterm@6"]), rank=0)
    with StopSignals() as stop:
        inj.maybe_sigterm(5)
        assert not stop.requested
        inj.maybe_sigterm(6)
        assert stop.requested and stop.signal_name == "SIGTERM"


def test_crash_flushes_then_dies_with_exit_1():
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from runtime.faults import FaultInjector, parse_faults
        inj = FaultInjector(parse_faults(["crash@7:0"]), rank=0, flush=lambda: print("flushed"))
        for step in range(5, 9):
            inj.before_step(step)
            print("step", step)
        print("survived")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["step 5", "step 6", "flushed"]
    assert "survived" not in proc.stdout
    assert "crash at step 7" in proc.stderr


def test_crash_checkpoint_dies_only_inside_its_steps_save():
    died = []
    inj = FaultInjector(parse_faults(["crash_checkpoint@4:1"]), rank=1, exit_fn=died.append)
    for step in range(2, 7):
        inj.before_step(step)  # not a step-start fault
        assert not died
    inj.maybe_crash_in_checkpoint(2)
    assert not died
    inj.maybe_crash_in_checkpoint(4)
    assert died == [1]
    other_rank = FaultInjector(parse_faults(["crash_checkpoint@4:1"]), rank=0, exit_fn=died.append)
    other_rank.maybe_crash_in_checkpoint(4)
    assert died == [1]


def test_fault_spec_applies():
    spec = FaultSpec("hang", 5, None, "hang@5")
    assert spec.applies(5, 0) and spec.applies(5, 3) and not spec.applies(4, 0)
