"""Document-masked attention (models/attention.py): a packed row equals its documents run alone; the
kernel ``Numerics`` (models/numerics.py) picks for each config and device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from core.config import ModelConfig
from core.exceptions import ConfigError
from models.numerics import Numerics
from models.attention import attend, causal_document_bool_mask

# Row 0 packs three documents, row 1 is one document filling the row.
DOC_LENGTHS = [[5, 7, 4], [16]]
SEQ_LEN = 16
QWEN3 = ModelConfig(
    arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa",
)
QWEN2 = dataclasses.replace(QWEN3, arch="qwen2", head_dim=None, tie_embeddings=False)


def _packing(lengths_per_row):
    """document_ids and per-document position_ids, both (B, T)."""
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths_per_row])
    position_ids = torch.tensor([[p for n in row for p in range(n)] for row in lengths_per_row])
    return document_ids, position_ids


def _spans(row):
    start = 0
    for length in row:
        yield start, start + length
        start += length


@pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3", "qwen2"])
def test_packed_forward_and_backward_equal_documents_alone(config):
    model = models.build(config, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, SEQ_LEN, config.vocab_size, generator=torch.Generator().manual_seed(2))
    document_ids, position_ids = _packing(DOC_LENGTHS)

    packed = model(ids, position_ids=position_ids, document_ids=document_ids)
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone_total = 0.0
    for b, row in enumerate(DOC_LENGTHS):
        for start, end in _spans(row):
            alone = model(ids[b : b + 1, start:end])  # no packing: positions 0.., plain causal
            assert (alone[0] - packed[b, start:end]).abs().max().item() <= 1e-5
            alone_total = alone_total + (alone[0] * weights[b, start:end]).sum()
    alone_total.backward()
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, packed_grads[name], atol=1e-5, rtol=1e-4), name


def test_without_document_mask_tokens_see_across_documents():
    # Guards the test above: packing without document_ids must differ, or that test proves nothing.
    model = models.build(QWEN3, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    document_ids, position_ids = _packing(DOC_LENGTHS[:1])
    with torch.no_grad():
        masked = model(ids, position_ids=position_ids, document_ids=document_ids)
        unmasked = model(ids, position_ids=position_ids)
    assert torch.equal(masked[:, :5], unmasked[:, :5])  # the first document has nothing before it
    assert (masked[:, 5:] - unmasked[:, 5:]).abs().max().item() > 1e-3


def test_single_document_mask_equals_plain_causal():
    model = models.build(QWEN3, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        one_doc = model(ids, document_ids=torch.zeros(2, SEQ_LEN, dtype=torch.long))
    assert (plain - one_doc).abs().max().item() <= 1e-6


def test_bool_mask_pattern():
    mask = causal_document_bool_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_grouped_query_heads_share_their_kv_head():
    # Query heads 0,1 use kv head 0 and heads 2,3 use kv head 1 (the checkpoints' grouping).
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    out = attend(q, k, v, None)
    for head in range(4):
        alone = attend(q[:, head : head + 1], k[:, head // 2 : head // 2 + 1], v[:, head // 2 : head // 2 + 1], None)
        assert torch.allclose(out[:, head : head + 1], alone, atol=1e-6)


def test_kernel_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    auto, flex, sdpa = Numerics(attention="auto"), Numerics(attention="flex"), Numerics(attention="sdpa")
    assert auto.attention_kernel(cpu) == "sdpa"
    assert auto.attention_kernel(cuda) == "flex"
    assert auto.attention_kernel(cuda, 256) == "flex"
    assert auto.attention_kernel(cuda, 112) == "sdpa"  # no flex kernel for it (H200)
    assert flex.attention_kernel(cuda, 112) == "flex"  # asked for: as asked
    assert sdpa.attention_kernel(cuda) == "sdpa"
    assert flex.attention_kernel(cpu) == "flex"
    with pytest.raises(ConfigError, match="model.attention"):
        Numerics(attention="flash")


def test_bad_document_ids_shape_is_rejected():
    model = models.build(QWEN3)
    with pytest.raises(ValueError, match="document_ids"):
        model(torch.zeros(2, 8, dtype=torch.long), document_ids=torch.zeros(2, 7, dtype=torch.long))


@pytest.mark.slow
def test_flex_on_cpu_matches_sdpa():
    # The flex path is the GPU default; inductor can also compile it for the CPU (about 20 s
    # cold), which checks our mask_mod, GQA and wiring here. benchmarks/attention_check.py
    # checks it on the GPU, backward included.
    sdpa = models.build(QWEN3, generator=torch.Generator().manual_seed(0))
    flex = models.build(dataclasses.replace(QWEN3, attention="flex"), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    document_ids, position_ids = _packing(DOC_LENGTHS)
    with torch.no_grad():
        expected = sdpa(ids, position_ids=position_ids, document_ids=document_ids)
        got = flex(ids, position_ids=position_ids, document_ids=document_ids)
        # Without document_ids: plain causal SDPA vs flex's cached causal BlockMask.
        causal_expected, causal_got = sdpa(ids), flex(ids)
    assert (expected - got).abs().max().item() <= 1e-5
    assert (causal_expected - causal_got).abs().max().item() <= 1e-5
