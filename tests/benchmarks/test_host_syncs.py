"""benchmarks/host_syncs.py: synchronising calls counted by call site, a step's apart from the run's
start and end (the warnings are raised here as PyTorch raises them in its sync debug mode)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from benchmarks import host_syncs

ROOT = Path(__file__).resolve().parents[2]


def _sync():
    warnings.warn(host_syncs.MESSAGE, UserWarning, stacklevel=2)  # PyTorch's words in its sync debug mode


def _metric_count():  # a step's wait, three times a step
    _sync()


def _run_step():  # named as training/loop.py's step; the file is checked too, so this is not one
    _metric_count()


def test_sites_are_counted_by_stack_and_other_warnings_pass_through():
    sites = host_syncs.Sites(frames=3)
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        previous = lambda *a, **k: shown.append(str(a[0]))  # noqa: E731
        warnings.showwarning = sites.hook(previous)
        for _ in range(3):
            _run_step()
        warnings.warn("something else")
    assert shown == ["something else"]
    [(key, count)] = sites.counts.items()
    assert count == 3 and key[0].startswith("tests/benchmarks/test_host_syncs.py:") and key[0].endswith(" _sync")
    assert key[1].endswith(" _metric_count") and len(key) == 3
    report = sites.report(steps=3)
    assert report["in_step_calls"] == 0 and report["other_calls"] == 3  # not training/loop.py's _run_step


def test_a_site_under_the_trainers_step_counts_per_step():
    import traceback

    sites = host_syncs.Sites(frames=2)
    step = traceback.FrameSummary(str(ROOT / "training" / "loop.py"), 327, "_run_step")
    build = traceback.FrameSummary(str(ROOT / "training" / "builders.py"), 90, "build_model")
    add = traceback.FrameSummary(str(ROOT / "training" / "step.py"), 189, "add")
    for _ in range(18):
        sites.record([step, add])
    sites.record([build, add])
    report = sites.report(steps=2)
    assert report["in_step_calls"] == 18 and report["other_calls"] == 1
    first = report["sites"][0]
    assert first["stack"] == ["training/step.py:189 add", "training/loop.py:327 _run_step"] and first["per_step"] == 9
    text = host_syncs.table(report)
    assert "18 synchronising calls in 2 steps, 1 outside them" in text and "| 18 | 9.00 |" in text
    assert "(start/end)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_it_says_there_is_nothing_to_find(capsys, tmp_path):
    assert host_syncs.main(["--out", str(tmp_path / "s.json"), "--", "--config", "configs/tiny.yaml"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_the_captured_stdout_answers_as_a_stream():
    """The run's stdout is kept and shown; the rest of a stream's interface is stdout's (GRPO's console
    asks ``isatty``: on the GPU the run died of it before its first step, 2026-12-04)."""
    tee = host_syncs._Tee()
    tee.write("run_dir: /tmp/x\n")
    assert tee.text() == "run_dir: /tmp/x\n"
    assert tee.isatty() == sys.__stdout__.isatty() and tee.encoding == sys.__stdout__.encoding
