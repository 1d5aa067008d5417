"""SIGTERM while a large frozen model (a distillation teacher) is being built ends the run at
once with exit 143, as a stop during start-up does, instead of waiting for a first step
boundary that is minutes away (runtime/signals.py ``StopSignals.at_once``, training/loop.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import save_file

from core import config as config_lib
from runtime.signals import StopDuringStartup, StopSignals
from tests import launch


def test_inside_at_once_a_stop_signal_raises_and_outside_it_waits_for_the_step_boundary():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signals = StopSignals(signals=(signal.SIGTERM,))
        with pytest.raises(StopDuringStartup) as info:
            with signals.at_once():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert info.value.exit_code == 143
        signals = StopSignals(signals=(signal.SIGTERM,))
        os.kill(os.getpid(), signal.SIGTERM)  # in the step loop: recorded, the loop stops at its boundary
        assert signals.requested
        with pytest.raises(StopDuringStartup):  # received before: at_once does not start
            with signals.at_once():
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow  # starts train.py
def test_sigterm_during_a_large_teacher_build_exits_143_promptly(tmp_path):
    from models.hf_config import hf_config_dict
    from models.qwen.dims import resolve_dims

    student = config_lib.load(launch.ROOT / "configs" / "tiny-distill.yaml", ["objective.distill.teacher=/x"]).model
    # ~10 s of module construction (no weights needed): a signal 5 s after run_dir lands inside it
    teacher = dataclasses.replace(student, num_layers=6000)
    directory = tmp_path / "teacher"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_dict(teacher, resolve_dims(teacher), "float32")))
    save_file({}, str(directory / "model.safetensors"))  # present (checked before the run dir), holding no tensor
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of some text to train on"}) + "\n" for i in range(64)))
    proc = subprocess.Popen(
        [sys.executable, str(launch.ROOT / "train.py"), "--config", str(launch.ROOT / "configs" / "tiny-distill.yaml"),
         f"objective.distill.teacher={directory}", "parallel.device=cpu", f"run.root={tmp_path / 'runs'}",
         f"data.sources=[{{path: {text}}}]", "data.eval_source=null", "data.num_streams=1"],
        cwd=tmp_path, env=launch.env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for line in proc.stdout:  # the run dir exists: the student, data and guards come next, then the teacher
            if line.startswith("run_dir:"):
                break
        time.sleep(5)
        assert proc.poll() is None, proc.stderr.read()
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert code == 143, err
    assert "SIGTERM" in err and elapsed < 15, (elapsed, err)
