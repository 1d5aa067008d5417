"""benchmarks/attention_check.py's flash varlen reference: the rows flattened into their
documents give the same attention as the exact document mask. The flash kernel needs CUDA;
a plain-torch kernel with its contract stands in for it here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.attention.varlen as varlen
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("attention_check", ROOT / "benchmarks" / "attention_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _varlen_contract(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, enable_gqa=False, **causal):
    """Causal attention within each [cu[i], cu[i+1]) of the (tokens, heads, D) stream."""
    assert causal in ({"is_causal": True}, {"window_size": (-1, 0)})
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert enable_gqa == (q.shape[1] != k.shape[1])
    out = torch.empty_like(q)
    bounds = cu_seq_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        assert 0 < end - start <= max_q == max_k
        segment = [x[start:end].transpose(0, 1)[None] for x in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*segment, is_causal=True, enable_gqa=enable_gqa)[0].transpose(0, 1)
    return out


def _varlen_without_gqa(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
    """An older signature: no grouped heads, causal as a window."""
    return _varlen_contract(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size)


def test_varlen_layout_marks_every_document():
    check = _load()
    document_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16, [0] + [1] * 15])
    cu_seqlens, max_len = check.varlen_document_mask(document_ids)
    assert cu_seqlens.tolist() == [0, 5, 12, 16, 32, 33, 48]
    assert max_len == 16


@pytest.mark.parametrize("kernel", [_varlen_contract, _varlen_without_gqa], ids=["gqa", "no-gqa"])
def test_varlen_reference_matches_the_document_mask(monkeypatch, kernel):
    check = _load()
    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    g = torch.Generator().manual_seed(0)
    document_ids = check.packed_document_ids(3, 64, 16, g)
    q = torch.randn(3, 4, 64, 16, generator=g)
    k, v = torch.randn(3, 2, 64, 16, generator=g), torch.randn(3, 2, 64, 16, generator=g)  # grouped heads
    got = check.attend_varlen(q, k, v, check.varlen_document_mask(document_ids))
    expected = check.attend(q, k, v, check.causal_document_bool_mask(document_ids))
    assert (got - expected).abs().max().item() < 1e-5
