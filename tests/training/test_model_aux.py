"""A model's auxiliary losses and metrics (models/forward.py's ``AuxLoss`` and ``ModelMetric``)
through training/step.py: the gradient carries each auxiliary loss divided by the global count of
its own unit, so neither the micro-batch split nor the number of ranks changes it; the model's
sums become ``model/*`` ledger fields, which replay compares.

The test model is Qwen with a penalty on its final hidden states: ``AUX_WEIGHT`` times the mean
over input tokens of each token's mean squared hidden value, and one metric per layer (the mean
squared activation after the block). The model runs in float64, so that sums in another order
(1 x 4 rows against 4 x 1, one rank against two) agree to within 1e-12 relative; they are not
bitwise equal, for the objective's loss either (the guarantee table compares 1 x 4 and 4 x 1
ledgers to a tolerance too)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from core.config import ModelConfig, ParallelConfig
from data.batch import IGNORE_INDEX, Batch
from models.forward import INPUT_TOKEN, TARGET_TOKEN, AuxLoss, ModelMetric, ModelOutput, model_forward
from models.qwen.model import QwenForCausalLM
from training.objectives.base import LossOutput
from models.numerics import Numerics
from training.precision import Precision
from training.record import ledger as ledger_lib
from training.step import forward_backward, local_units, model_fields

TINY = ModelConfig(
    arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, attention="sdpa",
)
AUX_WEIGHT = 0.25
ROWS, SEQ = 4, 10


class PenalizedQwen(QwenForCausalLM):
    """Qwen that also returns an auxiliary loss on its final hidden states and a metric per layer."""

    def forward(self, input_ids, position_ids=None, document_ids=None, head=None, cache=None, media=None):
        seq_len = input_ids.shape[1]
        positions = self.model_positions(input_ids, position_ids, media)
        mask = self.attention_mask(document_ids, seq_len, input_ids.device)
        rope = self.rotary_table(positions)
        hidden = self.embed_tokens(input_ids)  # (B, T, d)
        metrics = {}
        for layer, block in enumerate(self.layers):
            hidden = block(hidden, rope, mask)
            metrics[f"layer{layer}/mean_square"] = ModelMetric(hidden.detach().pow(2).mean(-1).sum(), input_ids.numel())
        hidden = self.norm(hidden)
        aux = {"hidden_l2": AuxLoss(hidden.pow(2).mean(-1).sum(), per=INPUT_TOKEN, weight=AUX_WEIGHT)}
        result = (ModelOutput(head=head(hidden, self.lm_head.weight)) if head is not None
                  else ModelOutput(logits=self.lm_head(hidden)))
        return replace(result, aux_losses=aux, metrics=metrics)


class TokenCrossEntropy:
    """The objective's side of the contract only: the cross-entropy sum over target tokens, in the
    model's dtype (causal_lm's loss upcasts to float32)."""

    def loss(self, model, micro) -> LossOutput:
        logits = model_forward(model, micro).logits  # (B, T, V)
        total = F.cross_entropy(logits.flatten(0, 1), micro.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return LossOutput(total, int((micro.labels != IGNORE_INDEX).sum()))


def penalized_model() -> PenalizedQwen:
    model = PenalizedQwen(TINY)
    model.init_weights(torch.Generator().manual_seed(11))
    return model.double()


def make_batch() -> Batch:
    generator = torch.Generator().manual_seed(12)
    ids = torch.randint(0, TINY.vocab_size, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, TINY.vocab_size, (ROWS, SEQ), generator=generator)
    labels[:, -3:] = IGNORE_INDEX  # positions without a target, more of them in row 1
    labels[1, :4] = IGNORE_INDEX
    return Batch(step=1, input_ids=ids, labels=labels, position_ids=torch.arange(SEQ).expand(ROWS, SEQ).clone(),
                 document_ids=torch.zeros(ROWS, SEQ, dtype=torch.long), sequence_index=list(range(ROWS)),
                 provenance=[[] for _ in range(ROWS)], state={})


def step_gradient(model, micro_batches, *, global_targets: int, units: dict[str, int], dp_size: int = 1):
    """forward_backward as the loop runs it (fp32 precision: no autocast); the flat gradient and sums."""
    model.zero_grad(set_to_none=True)
    precision = Precision(Numerics(precision="fp32"), device=torch.device("cpu"), wrapper_casts=False)
    loss, metrics, _ = forward_backward(model, micro_batches, objective=TokenCrossEntropy(), precision=precision,
                                        global_targets=global_targets, dp_size=dp_size, device=torch.device("cpu"),
                                        no_sync=lambda m: contextlib.nullcontext(), units=units)
    return flat_grad(model), loss, metrics


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_the_gradient_carries_the_aux_loss_over_the_global_tokens():
    model, batch = penalized_model(), make_batch()
    targets, units = batch.num_target_tokens(), local_units(batch)
    assert units == {INPUT_TOKEN: ROWS * SEQ, TARGET_TOKEN: targets, "row": ROWS}
    got, _, metrics = step_gradient(model, [batch], global_targets=targets, units=units)

    model.zero_grad(set_to_none=True)  # by hand: the objective's mean plus weight x the penalty's mean
    out = model_forward(model, batch)
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    (ce / targets + AUX_WEIGHT * out.aux_losses["hidden_l2"].sum / (ROWS * SEQ)).backward()
    torch.testing.assert_close(got, flat_grad(model), rtol=1e-12, atol=1e-15)

    model.zero_grad(set_to_none=True)  # the objective's gradient alone differs: the aux loss counts
    (TokenCrossEntropy().loss(model, batch).sum / targets).backward()
    assert not torch.allclose(got, flat_grad(model), rtol=1e-6, atol=0)

    # The sums that reach the ledger: the aux loss's value as added (weighted, per token), each metric's mean.
    fields = model_fields({name: float(value) for name, value in metrics.items()})
    assert sorted(fields) == ["model/aux/hidden_l2", "model/layer0/mean_square", "model/layer1/mean_square"]
    assert fields["model/aux/hidden_l2"] == pytest.approx(
        AUX_WEIGHT * float(out.aux_losses["hidden_l2"].sum.detach()) / (ROWS * SEQ), rel=1e-6)
    assert fields["model/layer1/mean_square"] == pytest.approx(
        float(out.metrics["layer1/mean_square"].sum) / (ROWS * SEQ), rel=1e-6)


@pytest.mark.parametrize("per", [INPUT_TOKEN, TARGET_TOKEN, "row"])
def test_accumulation_one_by_four_equals_four_by_one(per, monkeypatch):
    """Whatever unit the aux loss averages over, 4 micro-batches of one row give the gradient,
    loss and ledger fields of one micro-batch of four."""
    model, batch = penalized_model(), make_batch()
    forward = PenalizedQwen.forward

    def forward_per(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return replace(out, aux_losses={n: replace(a, per=per) for n, a in out.aux_losses.items()})

    monkeypatch.setattr(PenalizedQwen, "forward", forward_per)
    targets, units = batch.num_target_tokens(), local_units(batch)
    whole, whole_loss, whole_sums = step_gradient(model, batch.micro_batches(4), global_targets=targets, units=units)
    split, split_loss, split_sums = step_gradient(model, batch.micro_batches(1), global_targets=targets, units=units)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(split_loss, whole_loss, rtol=1e-12, atol=0)
    whole_fields = model_fields({n: float(v) for n, v in whole_sums.items()})
    split_fields = model_fields({n: float(v) for n, v in split_sums.items()})
    assert whole_fields.keys() == split_fields.keys()
    for name, value in whole_fields.items():
        assert split_fields[name] == pytest.approx(value, rel=1e-6), name
    # Dividing each micro-batch's aux loss by its own count instead would have given another gradient.
    local = step_gradient(model, batch.micro_batches(1), global_targets=targets,
                          units={k: v // ROWS for k, v in units.items()})[0]
    assert not torch.allclose(local, whole, rtol=1e-6, atol=0)


def _two_ranks(batch: Batch) -> dict:
    """One rank of two: its half of the rows, DDP averaging, the global counts summed over both ranks."""
    import torch.distributed as dist

    from core.distributed_context import DistributedContext
    from tests.distributed.dist_harness import keep_until_exit

    with DistributedContext.from_env(ParallelConfig(device="cpu", backend="gloo", timeout_s=60)) as context:
        model = keep_until_exit(torch.nn.parallel.DistributedDataParallel(penalized_model()))
        rows = batch.select([context.rank * 2, context.rank * 2 + 1])
        local = local_units(rows)
        counts = torch.tensor([rows.num_target_tokens(), *local.values()], dtype=torch.float64)
        dist.all_reduce(counts)
        units = {name: int(v) for name, v in zip(local, counts[1:].tolist())}
        grad, loss, sums = step_gradient(model, rows.micro_batches(1), global_targets=int(counts[0]), units=units,
                                         dp_size=2)
        summed = torch.stack([sums[n] for n in sorted(sums)])
        dist.all_reduce(summed)
        return {"grad": grad, "units": units, "sums": dict(zip(sorted(sums), summed.tolist()))}


def test_two_ranks_give_the_gradient_of_one():
    from tests.distributed.dist_harness import run_on_ranks

    batch = make_batch()
    one, _, one_sums = step_gradient(penalized_model(), batch.micro_batches(2), global_targets=batch.num_target_tokens(),
                                     units=local_units(batch))
    ranks = run_on_ranks(_two_ranks, 2, batch)
    for result in ranks:
        assert result["units"] == local_units(batch)
        torch.testing.assert_close(result["grad"], one, rtol=1e-12, atol=1e-15)
    fields = model_fields({n: float(v) for n, v in one_sums.items()})
    for name, value in model_fields(ranks[0]["sums"]).items():
        assert value == pytest.approx(fields[name], rel=1e-6), name


def test_the_ledger_gets_the_model_fields_and_replay_compares_them():
    model, batch = penalized_model(), make_batch()
    _, _, sums = step_gradient(model, batch.micro_batches(2), global_targets=batch.num_target_tokens(),
                               units=local_units(batch))
    fields = model_fields({n: float(v) for n, v in sums.items()})
    recorded = {"step": 1, "loss": 1.0, **fields}
    line = ledger_lib.dumps(recorded)
    assert all(f'"{name}":' in line for name in fields)
    assert ledger_lib.first_mismatch(recorded, dict(recorded)) is None
    changed = {**recorded, "model/layer0/mean_square": fields["model/layer0/mean_square"] * (1 + 1e-15) + 1e-300}
    assert ledger_lib.first_mismatch(recorded, changed) == "model/layer0/mean_square"
    missing = {k: v for k, v in recorded.items() if k != "model/aux/hidden_l2"}
    assert ledger_lib.first_mismatch(recorded, missing) == "model/aux/hidden_l2"


def test_a_model_without_aux_losses_adds_no_fields_and_keeps_the_gradient_bitwise():
    """Qwen itself: forward_backward's gradient is the objective's alone, bit for bit, with or
    without units; no model sums."""
    model = QwenForCausalLM(TINY)
    model.init_weights(torch.Generator().manual_seed(11))
    model = model.double()
    batch = make_batch()
    targets = batch.num_target_tokens()
    got, loss, sums = step_gradient(model, batch.micro_batches(2), global_targets=targets, units=local_units(batch))
    assert sums == {} and model_fields({}) == {}
    model.zero_grad(set_to_none=True)
    for micro in batch.micro_batches(2):
        (TokenCrossEntropy().loss(model, micro).sum * (1 / targets)).backward()
    assert torch.equal(got, flat_grad(model))


def test_frozen_and_no_grad_forwards_add_nothing():
    """A frozen model's forward inside the loss (a teacher), and any forward without gradients,
    are not the trained model's: their aux losses are not trained."""
    model, frozen, batch = penalized_model(), penalized_model(), make_batch()

    class WithTeacher(TokenCrossEntropy):
        def loss(self, model, micro):
            model_forward(frozen, micro)  # a frozen model with gradients on: not trained
            with torch.no_grad():
                model_forward(model, micro)  # the trained model without gradients: nothing to train
            return super().loss(model, micro)

    targets, units = batch.num_target_tokens(), local_units(batch)
    want, _, want_sums = step_gradient(model, [batch], global_targets=targets, units=units)
    model.zero_grad(set_to_none=True)
    precision = Precision(Numerics(precision="fp32"), device=torch.device("cpu"), wrapper_casts=False)
    _, sums, _ = forward_backward(model, [batch], objective=WithTeacher(), precision=precision, global_targets=targets,
                                  dp_size=1, device=torch.device("cpu"), no_sync=lambda m: contextlib.nullcontext(),
                                  units=units)
    assert torch.equal(flat_grad(model), want)
    assert sums.keys() == want_sums.keys()
    assert all(torch.equal(sums[n], want_sums[n]) for n in sums)


def test_the_console_line_shows_the_aux_losses():
    from experiments.console import ConsoleLine
    from experiments.schema import MetricRecord, MetricStats
    from experiments.sinks import format_progress

    means = {"loss": 2.5, "lr": 1e-3, "model/aux/hidden_l2": 0.01, "model/layer0/mean_square": 1.5}
    stats = {name: MetricStats(mean=v, min=v, max=v, sum=v) for name, v in means.items()}
    record = MetricRecord(step=3, time=0.0, world_size=1, interval_steps=1, metrics=stats)
    assert format_progress(record, 10, ConsoleLine()) == "step 3/10 | loss 2.5000 per token | aux hidden_l2 0.0100 | lr 1.00e-03"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run this file on a GPU machine")
def test_the_model_sums_reach_the_gpu_without_waiting_for_it():
    """A step's model sums on a GPU: their counts (host numbers) become device scalars without a copy
    from the host, which would wait for every queued kernel (training/step.py); the sums equal the
    CPU run's. The micro-batches stay on the host and the loss moves them, as the loop's objectives do."""
    device = torch.device("cuda")
    batch = make_batch()
    targets, units = batch.num_target_tokens(), local_units(batch)
    micro_batches = batch.micro_batches(2)

    class Placed(TokenCrossEntropy):
        def loss(self, model, micro):
            logits = model_forward(model, micro, place=lambda t: t.to(device, non_blocking=True)).logits
            labels = micro.labels.to(device, non_blocking=True)
            total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            return LossOutput(total, int((micro.labels != IGNORE_INDEX).sum()))  # counted on the host

    model = penalized_model().to(device)
    precision = Precision(Numerics(precision="fp32"), device=device, wrapper_casts=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, sums, _ = forward_backward(model, micro_batches, objective=Placed(), precision=precision,
                                      global_targets=targets, dp_size=1, device=device,
                                      no_sync=lambda m: contextlib.nullcontext(), units=units)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _, _, want = step_gradient(penalized_model(), micro_batches, global_targets=targets, units=units)
    assert sums.keys() == want.keys()
    for name in want:
        assert sums[name].device.type == "cuda"
        torch.testing.assert_close(sums[name].cpu(), want[name], rtol=1e-6, atol=0)
