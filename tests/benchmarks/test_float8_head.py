"""benchmarks/float8_head.py: the FP8 head prototype computes what its FP8 operands say (scales
and transposed layouts right), rounds like FP8 and no worse, and refuses shapes that
torch._scaled_mm cannot take. On CPU (torch._scaled_mm runs there too)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import float8_head as fh


def test_the_fp8_loop_is_the_matmuls_of_its_dequantized_operands():
    """With a loss whose gradient is a fixed G (loss = sum of logits), the loop's loss and
    gradients equal fp32 matmuls of the FP8 tensors times their inverse scales."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(48, 32, generator=gen) * 0.02).to(torch.bfloat16)
    labels = torch.zeros(64, dtype=torch.long)
    fixed = (torch.randn(64, 48, generator=gen) * 1e-3).to(torch.bfloat16)  # grows no larger than a softmax gradient

    def ce(logits, chunk_labels):
        start = ce.start
        ce.start += logits.shape[0]
        return logits.float().sum(), fixed[start : start + logits.shape[0]]

    ce.start = 0
    loss, grad_h, grad_w = fh.float8_head(hidden, weight, labels, chunk=16, backward_fast_accum=False,
                                          cast=fh.to_float8, ce=ce)

    def deq(x, dtype):
        x8, inv = fh.to_float8(x, dtype)
        return x8.float() * inv

    w = deq(weight, fh.E4M3)
    logits = torch.cat([deq(hidden[s : s + 16], fh.E4M3) @ w.t() for s in range(0, 64, 16)])
    g = torch.cat([deq(fixed[s : s + 16], fh.E5M2) for s in range(0, 64, 16)])
    h = torch.cat([deq(hidden[s : s + 16], fh.E4M3) for s in range(0, 64, 16)])
    torch.testing.assert_close(loss, logits.to(torch.bfloat16).float().sum(), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(grad_h.float(), (g @ w).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(grad_w.float(), (g.t() @ h).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-6)
    # And the scales are per tensor (per chunk for the hidden states): the amax maps to FP8's largest value.
    x8, inv = fh.to_float8(hidden[:16], fh.E4M3)
    assert x8.float().abs().max() == torch.finfo(fh.E4M3).max
    torch.testing.assert_close(inv, hidden[:16].abs().amax().float() / torch.finfo(fh.E4M3).max, rtol=1e-6, atol=0)


def test_cpu_run_writes_json_and_fp8_rounds_more_than_bf16(tmp_path, capsys):
    out = tmp_path / "head.json"
    assert fh.main(["--device", "cpu", "--tokens", "256", "--hidden", "64", "--vocab", "512", "--chunk", "128",
                    "--warmup", "1", "--repeat", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "| bf16 |" in printed and "| float8 |" in printed and "FP8 saves" in printed
    assert result["shape"] == {"tokens": 256, "hidden": 64, "vocab": 512, "chunk": 128}
    bf16, fp8 = result["bf16"], result["float8"]
    assert len(bf16["ms"]) == len(fp8["ms"]) == 2 and result["speedup"] == pytest.approx(bf16["ms_median"] / fp8["ms_median"])
    for name in ("grad_hidden_rel_err", "grad_weight_rel_err"):
        assert bf16[name] < fp8[name] < 0.1, name  # FP8 is applied, and rounds like FP8 (e5m2: 2 mantissa bits)
    assert bf16["loss_rel_to_fp32"] < 1e-4 and fp8["loss_rel_to_fp32"] < 1e-3


@pytest.mark.parametrize("flag", ["--tokens", "--hidden", "--vocab", "--chunk"])
def test_shapes_scaled_mm_cannot_take_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fh.main(["--device", "cpu", flag, "100"])
    assert exit_info.value.code == 2
    assert f"{flag} must be a positive multiple of 16" in capsys.readouterr().err


def test_the_static_logits_gradient_scale_fits_e5m2_and_rounds_like_the_dynamic_one():
    """softmax - one_hot is within [-1, 1]: at 2**15 it stays below e5m2's 57,344 even for a
    chunk whose logits are extreme, and it equals the fp32 gradient to e5m2's precision."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 64, generator=gen) * 30  # near one-hot softmaxes: gradients close to +-1
    labels = torch.randint(0, 64, (32,), generator=gen)
    labels[3] = -100  # ignored
    loss, g8 = fh.cross_entropy_float8_grad(logits.to(torch.bfloat16), labels)
    ref_loss, ref_grad = fh._cross_entropy_chunk(logits.to(torch.bfloat16).float(), labels)
    assert g8.dtype == fh.E5M2 and torch.equal(loss, ref_loss)
    grad = g8.float() / fh.LOGITS_GRAD_SCALE
    assert g8.float().abs().max() <= fh.LOGITS_GRAD_SCALE < torch.finfo(fh.E5M2).max
    assert torch.equal(grad[3], torch.zeros(64))
    big = ref_grad.abs() > 2**-14  # above e5m2's subnormals at this scale
    torch.testing.assert_close(grad[big], ref_grad[big], rtol=0.125, atol=0)


def test_static_scale_run_matches_the_dynamic_runs_errors(tmp_path):
    errors = {}
    for scale in ("dynamic", "static"):
        out = tmp_path / f"{scale}.json"
        fh.main(["--device", "cpu", "--tokens", "256", "--hidden", "64", "--vocab", "512", "--chunk", "128",
                 "--warmup", "0", "--repeat", "1", "--logits-grad-scale", scale, "--out", str(out)])
        result = json.loads(out.read_text())
        assert result["logits_grad_scale"] == scale
        errors[scale] = result["float8"]
    for name in ("grad_hidden_rel_err", "grad_weight_rel_err"):
        assert errors["static"][name] == pytest.approx(errors["dynamic"][name], rel=0.1), name
