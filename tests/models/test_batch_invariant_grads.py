"""The batch-invariant kernels' backwards (models/batch_invariant_grads.py): each closed form equals
autograd of its kernel's reference formula (in fp64 to rounding, in fp32 and bf16 within their
precision), and models/batch_invariant_triton.py's autograd functions return them for the inputs
that ask (checked here with Triton replaced by a stand-in module and the forwards by the
reference formulas: the kernels themselves need a GPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from models import batch_invariant_grads as grads


def _rand(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _autograd(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, grad)


@pytest.mark.parametrize("x_dtype,w_dtype,tol", [(torch.float64, torch.float64, 1e-12),
                                                 (torch.float32, torch.float32, 2e-5),
                                                 (torch.bfloat16, torch.float32, 2e-2),
                                                 (torch.bfloat16, torch.bfloat16, 3e-2)])
def test_rms_norm_grads_are_autograd_of_the_reference(x_dtype, w_dtype, tol):
    x = _rand(3, 5, 64, dtype=x_dtype) * 3
    weight = 1 + _rand(64, dtype=w_dtype, seed=1) / 4
    out_dtype = torch.promote_types(x_dtype, w_dtype)
    grad = _rand(3, 5, 64, dtype=out_dtype, seed=2)
    want_dx, want_dw = _autograd(lambda a, b: grads.rms_norm_reference(a, b, 1e-6), (x, weight), grad)
    dx, dw = grads.rms_norm_grads(x, weight, grad, 1e-6)
    assert dx.dtype == x_dtype and dw.dtype == w_dtype and dx.shape == x.shape and dw.shape == weight.shape
    torch.testing.assert_close(dx.double(), want_dx.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), want_dw.double(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_logsumexp_and_softmax_grads_are_autograd_of_the_references(dtype, tol):
    x = _rand(4, 7, 33, dtype=dtype) * 4
    lse_grad, soft_grad = _rand(4, 7, dtype=torch.float32, seed=3), _rand(4, 7, 33, dtype=torch.float32, seed=4)
    (want,) = _autograd(grads.logsumexp_reference, (x,), lse_grad.to(torch.promote_types(dtype, torch.float32)))
    torch.testing.assert_close(grads.logsumexp_grads(x, lse_grad).double(), want.double(), rtol=tol, atol=tol)
    (want,) = _autograd(grads.softmax_reference, (x,), soft_grad.to(torch.promote_types(dtype, torch.float32)))
    torch.testing.assert_close(grads.softmax_grads(x, soft_grad).double(), want.double(), rtol=tol, atol=tol)


def _dense(q, k, v, positions, documents, relative):
    """The attention's reference: softmax of the scaled scores over ``allowed_keys``, in fp32 (fp64 stays)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    allowed = grads.allowed_keys(positions, documents, relative, batch, k_len)
    qg = q.to(dtype).reshape(batch, kv_heads, groups * q_len, head_dim)
    scores = (qg @ k.to(dtype).transpose(-1, -2) * head_dim**-0.5).view(batch, kv_heads, groups, q_len, k_len)
    probs = scores.masked_fill(~allowed[:, None, None], float("-inf")).softmax(dim=-1)
    out = probs.view(batch, kv_heads, groups * q_len, k_len) @ v.to(dtype)
    return out.view(batch, heads, q_len, head_dim).to(q.dtype)


def _packed_layout():
    """Two rows of 12: documents of 5 and 7 tokens, and one of 12 (positions from 0 at each start)."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    return positions, documents


@pytest.mark.parametrize("case", ["packed", "no documents", "cache"])
def test_attention_grads_are_autograd_of_the_dense_attention(case):
    positions, documents = _packed_layout()
    relative = case != "cache"
    if case == "no documents":
        positions, documents = torch.arange(12)[None], None
    k_len = 16 if case == "cache" else 12
    if case == "cache":  # slots 0..position of each query; the cache has 4 slots more than queries
        positions, documents = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]] * 2), None
    q = _rand(2, 4, 12, 8)  # 4 query heads over 2 key/value heads
    k, v = _rand(2, 2, k_len, 8, seed=1), _rand(2, 2, k_len, 8, seed=2)
    grad = _rand(2, 4, 12, 8, seed=3)
    want = _autograd(lambda a, b, c: _dense(a, b, c, positions, documents, relative), (q, k, v), grad)
    got = grads.attention_grads(q, k, v, positions, documents, grad, relative)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    # Lower precision: bf16 value and fp32 queries and keys (the autocast trainer's), each grad in its input's dtype.
    q32, k32, vb = q.float(), k.float(), v.bfloat16()
    got = grads.attention_grads(q32, k32, vb, positions, documents, grad.float(), relative)
    assert [g.dtype for g in got] == [torch.float32, torch.float32, torch.bfloat16]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- the autograd functions


@pytest.fixture
def triton_module(monkeypatch):
    """models/batch_invariant_triton.py imported over a stand-in ``triton`` (decorators that return the
    function, the helpers its launches call): the autograd functions' plumbing, without a GPU."""
    language = types.ModuleType("triton.language")
    language.constexpr = object
    stub = types.ModuleType("triton")
    stub.jit = lambda *args, **kwargs: args[0] if args and callable(args[0]) else (lambda fn: fn)
    stub.language = language
    monkeypatch.setitem(sys.modules, "triton", stub)
    monkeypatch.setitem(sys.modules, "triton.language", language)
    monkeypatch.delitem(sys.modules, "models.batch_invariant_triton", raising=False)
    import models
    import models.batch_invariant_triton as module

    yield module
    # Unimported again, so that no later test finds this stand-in's module (as the package's attribute).
    sys.modules.pop("models.batch_invariant_triton", None)
    if getattr(models, "batch_invariant_triton", None) is module:
        delattr(models, "batch_invariant_triton")


def test_the_row_functions_return_the_closed_form_grads(triton_module):
    x, weight = _rand(6, 32, dtype=torch.float32), 1 + _rand(32, dtype=torch.float32, seed=1) / 4
    grad = _rand(6, 32, dtype=torch.float32, seed=2)

    def reference_norm(a, b, eps):
        return grads.rms_norm_reference(a, b, eps)

    leaves = [x.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    out = triton_module._differentiable(reference_norm, grads.rms_norm_grads, *leaves, 1e-6)
    dx, dw = torch.autograd.grad(out, leaves, grad)
    want_dx, want_dw = grads.rms_norm_grads(x, weight, grad, 1e-6)
    assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    # Only the weight asks: x gets None, the weight its gradient.
    leaf = weight.clone().requires_grad_(True)
    out = triton_module._differentiable(reference_norm, grads.rms_norm_grads, x, leaf, 1e-6)
    (dw,) = torch.autograd.grad(out, [leaf], grad)
    assert torch.equal(dw, want_dw)
    # Without a weight (the log-partition): one gradient.
    leaf = x.clone().requires_grad_(True)
    out = triton_module._differentiable(lambda a: grads.logsumexp_reference(a), grads.logsumexp_grads, leaf, None)
    (dx,) = torch.autograd.grad(out, [leaf], grad[:, 0])
    assert torch.equal(dx, grads.logsumexp_grads(x, grad[:, 0]))


def test_the_attention_function_returns_the_closed_form_grads(triton_module, monkeypatch):
    monkeypatch.setattr(triton_module, "attention_forward", _dense)
    positions, documents = _packed_layout()
    q = _rand(2, 4, 12, 8, dtype=torch.float32)
    k, v = _rand(2, 2, 12, 8, dtype=torch.float32, seed=1), _rand(2, 2, 12, 8, dtype=torch.bfloat16, seed=2)
    grad = _rand(2, 4, 12, 8, dtype=torch.float32, seed=3)
    leaves = [q.clone().requires_grad_(True), k.clone(), v.clone().requires_grad_(True)]  # k asks for none
    out = triton_module.attend(*leaves, positions, documents)
    dq, dv = torch.autograd.grad(out, [leaves[0], leaves[2]], grad)
    want_dq, _, want_dv = grads.attention_grads(q, k, v, positions, documents, grad, True)
    assert torch.equal(dq, want_dq) and torch.equal(dv, want_dv)
