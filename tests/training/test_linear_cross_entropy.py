"""The fused output projection + cross entropy equals the plain logits path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.config import ModelConfig
from models.qwen.model import QwenForCausalLM
from training.linear_cross_entropy import linear_cross_entropy
from training.losses import IGNORE_INDEX, CausalLMLoss


def _inputs(dtype=torch.float32, vocab=37, tokens=(3, 50), dim=16):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(*tokens, dim, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, tokens, generator=gen)
    labels[0, :7] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    return hidden, weight, labels


def _reference(hidden, weight, labels, scale):
    logits = (hidden @ weight.t()).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 7, 32, 150, 10_000])
def test_fp32_matches_cross_entropy_for_any_chunking(chunk):
    hidden, weight, labels = _inputs()
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, labels, scale=0.37)
    hidden.grad = weight.grad = None
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    (loss * 0.37).backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-5)
    assert hidden.grad.dtype == hidden.dtype and weight.grad.dtype == weight.dtype


def test_ignored_tokens_contribute_nothing():
    hidden, weight, labels = _inputs()
    labels[:] = IGNORE_INDEX
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad.abs().max().item() == 0.0 and weight.grad.abs().max().item() == 0.0


def test_bf16_within_rounding_and_bitwise_repeatable():
    hidden, weight, labels = _inputs(torch.bfloat16)
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, labels, scale=1.0)
    grads = []
    for _ in range(2):
        hidden.grad = weight.grad = None
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=40)
        loss.backward()
        grads.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    for a, b in zip(grads[0], grads[1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(grads[0][0], ref_loss, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(grads[0][1].float(), ref_dh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0][2].float(), ref_dw.float(), rtol=2e-2, atol=4e-2)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, labels = _inputs()
    weight.requires_grad_(False)
    linear_cross_entropy(hidden, weight, labels, chunk_tokens=8).backward()
    assert weight.grad is None and hidden.grad is not None


def _tiny_model():
    config = ModelConfig(
        arch="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, tie_embeddings=True,
    )
    model = QwenForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize("autocast", [False, True])
def test_model_head_hook_equals_logits_path(autocast):
    """Through the model (tied weights), under bf16 autocast too: same loss and gradients."""

    class Batch:
        pass

    batch = Batch()
    gen = torch.Generator().manual_seed(2)
    batch.input_ids = torch.randint(0, 97, (2, 24), generator=gen)
    batch.labels = torch.randint(0, 97, (2, 24), generator=gen)
    batch.labels[1, :5] = IGNORE_INDEX
    results = []
    for fused in (False, True):
        model = _tiny_model()
        loss_fn = CausalLMLoss(chunk_tokens=10 if fused else 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if fused:
                loss = model(batch.input_ids, head=lambda h, w: loss_fn.head_loss(h, w, batch))
            else:
                loss = loss_fn(model(batch.input_ids), batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (fused_loss, fused_grads) = results
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_loss, plain_loss, **tol)
    assert plain_grads.keys() == fused_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], **tol, msg=name)
