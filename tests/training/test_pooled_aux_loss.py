"""Qwen3-MoE's load-balancing loss over the global batch (models/forward.py ``PooledProductLoss``,
training/step.py): the step sums every micro-batch's and rank's tokens per expert before it forms the
loss, so 1 x 4 rows and 4 x 1 give the same value and gradient, and so do 2 ranks and 1 (gloo, DDP). The values differ only by sums in another order (the router's probabilities per
expert summed over other tokens): the value came out equal, the gradients within 1e-6; the per-forward
loss it replaces was 1e-2 apart.
One micro-batch on one rank computes the forward's own value with the same operations, bit for bit."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

from core.config import ParallelConfig
from core.distributed_context import DistributedContext
from data.batch import IGNORE_INDEX, Batch
from models.builder import build
from models.forward import INPUT_TOKEN, ModelInputs, PooledProductLoss, model_forward, record_emitted
from models.numerics import Numerics
from training.precision import Precision
from training.step import AUX_PREFIX, forward_backward, local_units, model_fields
from tests.models.test_qwen3_moe import VOCAB, _config
from tests.distributed.dist_harness import keep_until_exit
from tests.training.test_model_aux import TokenCrossEntropy

ROWS, SEQ = 4, 10
COEF = 0.5
"""A large coefficient, so that the balancing loss's share of the gradient is plain to compare."""


def _model():
    config = _config(router_aux_loss_coef=COEF, norm_topk_prob=True)
    model = build(config, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # routers far from uniform: uneven loads, which a split would see differently
        for layer in (0, 2):
            model.layers[layer].mlp.gate.weight.mul_(30.0)
    return model


def _batch(rows: slice = slice(None)) -> Batch:
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels[:, -2:] = IGNORE_INDEX
    index = list(range(ROWS))[rows]
    return Batch(step=1, input_ids=ids[rows], labels=labels[rows],
                 position_ids=torch.arange(SEQ).expand(ROWS, SEQ)[rows].clone(),
                 document_ids=torch.zeros(ROWS, SEQ, dtype=torch.long)[rows], sequence_index=index,
                 provenance=[[] for _ in index], state={})


def _step(model, micro_batches, *, dp_size: int = 1, sum_over_replicas=None):
    """forward_backward as the loop runs it (fp32) with the whole batch's counts; gradients and model fields."""
    whole = _batch()
    model.zero_grad(set_to_none=True)
    precision = Precision(Numerics(precision="fp32"), device=torch.device("cpu"), wrapper_casts=False)
    _, sums, _ = forward_backward(model, micro_batches, objective=TokenCrossEntropy(), precision=precision,
                                  global_targets=whole.num_target_tokens(), dp_size=dp_size,
                                  device=torch.device("cpu"), no_sync=lambda m: contextlib.nullcontext(),
                                  units=local_units(whole), sum_over_replicas=sum_over_replicas)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, sums


def _whole_batch_value(model) -> float:
    """The balancing loss of one forward over all rows (transformers' number for the batch), weighted."""
    with torch.no_grad():
        aux = model_forward(model, ModelInputs(_batch().input_ids)).aux_losses["load_balance"]
    assert isinstance(aux, PooledProductLoss) and aux.per == INPUT_TOKEN
    return COEF * float(aux.value(aux.counts, aux.sums, aux.units))


def _assert_same_step(got, want, *, rel: float) -> None:
    (grads, sums), (want_grads, want_sums) = got, want
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    key = AUX_PREFIX + "load_balance"
    value, wanted = model_fields(sums)[key], model_fields(want_sums)[key]
    assert value == pytest.approx(float(wanted), rel=rel)


def test_one_micro_batch_computes_the_forwards_value_with_the_same_operations():
    """One forward is the global batch: the step's gradient and value are the per-forward loss's bits
    (``AuxLoss``'s arithmetic: its sum times weight * dp_size / the global tokens)."""
    model, batch = _model(), _batch()
    grads, sums = _step(model, [batch])
    model.zero_grad(set_to_none=True)
    with record_emitted([model]) as emitted:
        out = TokenCrossEntropy().loss(model, batch)
    (aux,) = [aux for _, aux in emitted.aux_losses()]
    tokens = ROWS * SEQ
    (out.sum * (1 / batch.num_target_tokens()) + aux.sum * (aux.weight * 1 / tokens)).backward()
    for name, param in model.named_parameters():
        assert torch.equal(grads[name], param.grad), name
    value = model_fields(sums)[AUX_PREFIX + "load_balance"]
    assert torch.equal(value, aux.sum.detach().float() * aux.weight / float(tokens))


def test_accumulation_one_by_four_equals_four_by_one():
    model = _model()
    whole = _step(model, _batch().micro_batches(ROWS))
    split = _step(model, _batch().micro_batches(1))
    _assert_same_step(split, whole, rel=1e-7)
    value = float(model_fields(split[1])[AUX_PREFIX + "load_balance"])
    assert value == pytest.approx(_whole_batch_value(model), rel=1e-7)
    # What the step added before: each micro-batch's own loss, weighted by its tokens.
    per_forward = []
    for micro in _batch().micro_batches(1):
        with torch.no_grad():
            aux = model_forward(model, ModelInputs(micro.input_ids)).aux_losses["load_balance"]
        per_forward.append(COEF * float(aux.value(aux.counts, aux.sums, aux.units)))
    assert not math.isclose(sum(per_forward) / ROWS, value, rel_tol=1e-3)


def _two_ranks() -> dict:
    """One of 2 gloo ranks (tests/distributed/dist_harness.py): its half of the rows, one row a
    micro-batch, under DDP; the averaged gradients and the model sums over both ranks."""
    with DistributedContext.from_env(ParallelConfig(device="cpu", backend="gloo", timeout_s=60)) as context:
        model = keep_until_exit(torch.nn.parallel.DistributedDataParallel(_model()))
        half = _batch(slice(context.rank * 2, context.rank * 2 + 2))

        def sum_over_replicas(tensor: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(tensor)
            return tensor

        grads, sums = _step(model, half.micro_batches(1), dp_size=2, sum_over_replicas=sum_over_replicas)
        for value in sums.values():
            dist.all_reduce(value)
        return {"grads": {name.removeprefix("module."): grad for name, grad in grads.items()}, "sums": sums}


@pytest.mark.slow
def test_two_ranks_equal_one_rank():
    from tests.distributed.dist_harness import run_on_ranks

    one = _step(_model(), _batch().micro_batches(ROWS))
    for result in run_on_ranks(_two_ranks, 2):
        _assert_same_step((result["grads"], result["sums"]), one, rel=1e-7)
