"""runtime/profiler.py: exclusive phase timing, listeners, and a real chrome trace window."""

import json

import pytest
import torch

from core.config import RuntimeConfig
from runtime.profiler import PHASES, ProfilerWindow, StepTimer


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Recorder:
    def __init__(self):
        self.seen = []

    def on_phase(self, step, phase):
        self.seen.append((step, phase))


def test_phases_are_exclusive_and_add_up_to_the_step():
    clock, rec = Clock(), Recorder()
    timer = StepTimer(device="cpu", listeners=[rec], clock=clock, annotate=False)
    timer.start_step(7)
    with timer.phase("data_wait"):
        clock.now += 2.0
    clock.now += 0.5  # outside any phase
    with timer.phase("backward"):
        clock.now += 1.0
        with timer.phase("communication"):  # nested: paused backward
            clock.now += 3.0
        clock.now += 1.0
    out = timer.end_step()
    assert set(PHASES) <= set(out)
    assert out["data_wait"] == 2.0 and out["backward"] == 2.0 and out["communication"] == 3.0
    assert out["forward"] == 0.0 and out["device_sync"] == 0.0
    assert out["other"] == pytest.approx(0.5)
    assert sum(out.values()) == pytest.approx(7.5)  # the values add up to the step time
    summary = timer.summary()
    assert summary["step"] is None and summary["last_step"] == 7 and summary["last_step_times"] == out
    assert rec.seen == [
        (7, "step_start"), (7, "data_wait"), (7, "backward"), (7, "communication"), (7, "step_end")
    ]


def test_misuse_is_refused():
    timer = StepTimer(device="cpu")
    with pytest.raises(RuntimeError, match="outside a step"):
        with timer.phase("forward"):
            pass
    with pytest.raises(RuntimeError, match="without start_step"):
        timer.end_step()
    timer.start_step(1)
    with timer.phase("forward"):
        with pytest.raises(RuntimeError, match="inside open phase"):
            timer.end_step()


def _train(timer, window, steps, model, opt):
    for step in range(1, steps + 1):
        window.before_step(step)
        timer.start_step(step)
        with timer.phase("forward"):
            loss = model(torch.randn(8, 16)).square().mean()
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        timer.end_step()
        window.after_step(step)


def test_profiler_window_writes_one_chrome_trace_with_phase_annotations(tmp_path):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = ProfilerWindow(RuntimeConfig(profile_start_step=2, profile_steps=2), trace_dir=tmp_path, rank=3)
    _train(StepTimer(device="cpu"), window, 5, model, opt)
    window.close()
    assert [p.name for p in tmp_path.iterdir()] == ["rank3_steps2-3.json"]
    trace = json.loads((tmp_path / "rank3_steps2-3.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer"} <= names
    steps = sorted(n for n in names if n.startswith("lockstep_step#"))
    assert steps == ["lockstep_step#2", "lockstep_step#3"]


def test_profiler_window_disabled_or_missed_writes_nothing_and_close_flushes_partial(tmp_path):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = ProfilerWindow(RuntimeConfig(profile_start_step=0), trace_dir=tmp_path / "off", rank=0)
    _train(StepTimer(device="cpu"), off, 2, model, opt)
    assert not off.enabled and not (tmp_path / "off").exists()

    partial = ProfilerWindow(RuntimeConfig(profile_start_step=2, profile_steps=5), trace_dir=tmp_path / "p", rank=0)
    _train(StepTimer(device="cpu"), partial, 3, model, opt)  # run ends inside the window
    assert partial.active
    partial.close()
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["rank0_steps2-3.json"]


def test_summary_shows_the_open_phase():
    clock = Clock()
    timer = StepTimer(device="cpu", clock=clock, annotate=False)
    timer.start_step(3)
    with timer.phase("backward"):
        with timer.phase("communication"):
            clock.now += 4.0
            summary = timer.summary()
    assert summary["step"] == 3 and summary["open_phases"] == ["backward", "communication"]
    assert summary["seconds_in_step"] == 4.0


def test_step_only_api_counts_steps_from_first_step(tmp_path):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = ProfilerWindow(
        RuntimeConfig(profile_start_step=11, profile_steps=2), trace_dir=tmp_path, rank=0, first_step=10
    )
    window.begin()
    for _ in range(4):  # steps 10..13 of a resumed run
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        window.step()
    window.close()
    assert [p.name for p in tmp_path.iterdir()] == ["rank0_steps11-12.json"]
