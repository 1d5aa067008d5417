"""benchmarks/float8_head.py: a CPU run times both heads through the training path, writes
JSON whose FP8 errors are FP8's, and refuses shapes that torch._scaled_mm cannot take."""

from __future__ import annotations

import json

import pytest

from benchmarks import float8_head as fh


def test_cpu_run_writes_json_and_fp8_rounds_more_than_bf16(tmp_path, capsys):
    out = tmp_path / "head.json"
    assert fh.main(["--device", "cpu", "--tokens", "250", "--hidden", "64", "--vocab", "512", "--chunk", "128",
                    "--warmup", "1", "--repeat", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "| bf16 |" in printed and "| float8 |" in printed and "FP8 saves" in printed
    assert result["shape"] == {"tokens": 250, "hidden": 64, "vocab": 512, "chunk": 128}
    bf16, fp8 = result["bf16"], result["float8"]
    assert len(bf16["ms"]) == len(fp8["ms"]) == 2 and result["speedup"] == pytest.approx(bf16["ms_median"] / fp8["ms_median"])
    for name in ("grad_hidden_rel_err", "grad_weight_rel_err"):
        assert bf16[name] < fp8[name] < 0.1, name  # FP8 is applied, and rounds like FP8 (e5m2: 2 mantissa bits)
    assert bf16["loss_rel_to_fp32"] < 1e-4 and fp8["loss_rel_to_fp32"] < 1e-3


@pytest.mark.parametrize("flag", ["--hidden", "--vocab"])
def test_shapes_scaled_mm_cannot_take_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fh.main(["--device", "cpu", flag, "100"])
    assert exit_info.value.code == 2
    assert f"{flag} must be a positive multiple of 16" in capsys.readouterr().err
