"""Qwen3-MoE's dispatch under torch.compile (models/qwen3_moe/moe.py, ``Experts._loop``): the experts'
loop reads no block size in a Python branch, so the sampler's whole-graph compile (``fullgraph=True,
dynamic=False``) traces the tiny model's full and cached forwards, and they compute the eager bits.
TorchDynamo's ``eager`` backend is what traces the Python (a few seconds on CPU); the kernels it runs
are the eager ones, so equality is bitwise."""

from __future__ import annotations

import torch

from models.builder import build
from models.forward import ModelInputs, model_forward
from models.generation.kv_cache import KVCache
from models.qwen3_moe.dims import resolve_moe_dims
from models.qwen3_moe.moe import Experts
from tests.models.test_qwen3_moe import _config, _ids


def _whole_graph(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False, backend="eager")


def test_the_full_and_cached_forwards_compile_whole_and_compute_the_eager_bits():
    model = build(_config(), generator=torch.Generator().manual_seed(0)).eval()
    ids = _ids(seed=2)
    with torch.no_grad():
        eager = model_forward(model, ModelInputs(ids))
        compiled = _whole_graph(lambda i: model(i))(ids)
        assert torch.equal(compiled.logits, eager.logits)
        assert torch.equal(compiled.aux_losses["load_balance"].sum, eager.aux_losses["load_balance"].sum)

        positions = torch.arange(ids.shape[1]).expand_as(ids)
        caches = [KVCache.for_spec(model.generation_spec(), batch=ids.shape[0], slots=16) for _ in range(2)]
        want = model_forward(model, ModelInputs(ids, position_ids=positions), cache=caches[0]).logits
        step = _whole_graph(lambda i, p, c: model(i, position_ids=p, cache=c))
        assert torch.equal(step(ids, positions, caches[1]), want)


def test_experts_without_rows_get_zero_gradients_not_none():
    # Expert parallelism can hand a rank no row for any of its experts: every block is empty.
    experts = Experts(resolve_moe_dims(_config()), kernel="loop")
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.zeros(0, 32, requires_grad=True)
    out = experts(x, torch.zeros(6, dtype=torch.int64))
    assert out.shape == (0, 32)
    (out.sum() + 0.0 * x.sum()).backward()
    for name, param in experts.named_parameters():
        assert param.grad is not None and not param.grad.any(), name
