"""The dpo objective's loss equals the DPO formula computed by hand from full logits, for a
tiny model on a batch of two rows holding three pairs; fused (chunked head) and logits paths
agree; cached-style ``ref_logps`` extras hold each sequence's sum at its first target token."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import models
from core import seeding
from core.config import load
from core.exceptions import CheckpointError, ConfigError
from data.batch import Batch, DocSpan
from data.fields import TARGET_MASK
from data.preference import PAIR_ROLE
from training.objectives.base import ObjectiveContext
from training.objectives.dpo import DPOObjective, pair_layout

T = 32
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _batch():
    rng = np.random.default_rng(0)
    tokens, spans, masks, roles = [], [], [], []
    for row in range(2):
        ids = rng.integers(0, 256, T).astype(np.int32)
        mask = np.zeros(T, dtype=bool)
        role = np.zeros(T, dtype=np.int8)
        row_spans = []
        # (start, response start, end) of each document: row 0 holds two pairs, row 1 one and padding
        docs = [(0, 5, 8), (8, 13, 16), (16, 21, 24), (24, 29, 32)] if row == 0 else [(0, 6, 10), (10, 16, 20)]
        for d, (lo, resp, hi) in enumerate(docs):
            mask[resp:hi] = True
            role[lo:hi] = 1 + d % 2
            row_spans.append(DocSpan("s", "f", row * 10 + d // 2, lo, hi, 0 if d % 2 == 0 else 1))
        if row == 1:
            row_spans.append(DocSpan("<padding>", "", -1, 20, T, 0))
        tokens.append(ids), spans.append(row_spans), masks.append(mask), roles.append(role)
    return Batch.from_rows(1, tokens, spans, [0, 1], {}, {TARGET_MASK: masks, PAIR_ROLE: roles})


def _objective(fuse_head: bool, loss: str = "sigmoid", overrides=()):
    config = load(None, ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
                         "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
                         "parallel.strategy=none", f"objective.dpo.loss={loss}", "objective.dpo.beta=0.5",
                         "train.loss_chunk_tokens=7", "train.micro_batch_size=2", *overrides])
    model = models.build(config.model, generator=seeding.generator(0, "model_init"))
    with torch.no_grad():  # the policy moves away from its reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")
    objective = DPOObjective(config)
    objective.setup(model, ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                                            place=lambda t: t, fuse_head=fuse_head))
    return objective, model


def _sums(model, batch):
    """Per pair (chosen, rejected) summed response log-probs from full logits, by hand."""
    with torch.no_grad():
        logits = model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids)
    logp = torch.log_softmax(logits.double(), -1)
    out = []
    for row, spans in enumerate(batch.provenance):
        docs = [s for s in spans if s.record >= 0]
        for k in range(0, len(docs), 2):
            pair = []
            for span in docs[k:k + 2]:
                total = 0.0
                for t in range(span.start, span.end - 1):
                    label = int(batch.labels[row, t])
                    if label >= 0:
                        total += float(logp[row, t, label])
                pair.append(total)
            out.append(pair)
    return out


@pytest.mark.parametrize("fuse_head", [True, False])
def test_dpo_loss_is_the_formula_from_full_logits(fuse_head):
    objective, model = _objective(fuse_head)
    batch = objective.prepare(_batch())
    assert objective.num_targets(batch) == 3
    policy, reference = _sums(model, batch), _sums(objective.reference.module, batch)
    expected = sum(-math.log(1 / (1 + math.exp(-0.5 * ((pc - rc) - (pr - rr)))))
                   for (pc, pr), (rc, rr) in zip(policy, reference))
    out = objective.loss(model, batch)
    assert out.count == 3
    assert float(out.sum.detach()) == pytest.approx(expected, rel=1e-5)
    margins = sum(0.5 * ((pc - rc) - (pr - rr)) for (pc, pr), (rc, rr) in zip(policy, reference))
    assert float(out.metrics["margins"]) == pytest.approx(margins, rel=1e-4, abs=1e-6)
    out.sum.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_reference_free_losses_build_no_reference():
    objective, model = _objective(True, loss="simpo")
    assert objective.reference is None and objective.frozen_identity() == {}
    batch = objective.prepare(_batch())
    assert "ref_logps" not in batch.extras
    out = objective.loss(model, batch)
    assert out.count == 3 and torch.isfinite(out.sum)


# --------------------------------------------------------------------------- reference: adapter_off

LORA_OVERRIDES = ["model.lora.rank=4", "model.lora.alpha=8.0"]


def _lora_objective(reference: str, *, seed: int = 0, overrides=()):
    """A LoRA policy (non-zero B: it has moved away from its base) and a DPO objective on it."""
    from models.lora import add_adapters, lora_modules

    config = load(CONFIGS / "e2e-dpo.yaml", [  # its preference sources: the cache's fingerprint reads them
                         "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
                         "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "parallel.strategy=none",
                         "objective.dpo.beta=0.5", "train.loss_chunk_tokens=7", "train.micro_batch_size=2",
                         f"train.seed={seed}", f"objective.dpo.reference={reference}", *LORA_OVERRIDES, *overrides])
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    identity = add_adapters(model, config.model, seed=config.train.seed)
    with torch.no_grad():
        for i, module in enumerate(lora_modules(model)):
            module.lora_B.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(i))
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")
    objective = DPOObjective(config)
    objective.setup(model, ObjectiveContext(config=config, dist=dist, place=lambda t: t, fuse_head=True,
                                            parallel=SimpleNamespace(device=dist.device, base_identity=identity)))
    return objective, model, identity


def test_adapter_off_reference_is_the_separately_built_base_bit_for_bit():
    off, policy, identity = _lora_objective("adapter_off")
    init, _, _ = _lora_objective("init")  # a second, plain model from the same seeded init
    assert off.reference.module is policy  # no second copy
    assert off.frozen_identity() == {"reference": identity}
    batch = _batch()
    expected = init._reference_sums(batch)
    assert off._reference_sums(batch) == expected  # floats from fp32: bit for bit
    assert torch.equal(off.prepare(batch).extras["ref_logps"], init.prepare(batch).extras["ref_logps"])
    with torch.no_grad():
        assert off._pair_sums(policy, batch, pair_layout(batch)).tolist() != expected  # the adapters matter
    out = off.loss(policy, off.prepare(batch))
    assert out.count == 3 and float(out.metrics["margins"]) != 0.0


def test_adapter_off_reference_cache_is_fingerprinted_by_the_base(tmp_path):
    # The fingerprint reads the data sources: a file of our own (the batch itself is synthetic).
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\n')
    cache = ["objective.dpo.cache_reference=true", f"objective.dpo.cache_dir={tmp_path / 'cache'}",
             f"data.sources=[{{path: {pairs}, record: preference}}]", "data.eval_source=null"]
    online, _, _ = _lora_objective("adapter_off")
    filling, _, _ = _lora_objective("adapter_off", overrides=cache)
    batch = _batch()
    assert filling.prepare(batch).extras["ref_logps"].equal(online.prepare(batch).extras["ref_logps"])
    reading, _, _ = _lora_objective("adapter_off", overrides=cache)
    assert torch.equal(reading.prepare(batch).extras["ref_logps"], online.prepare(batch).extras["ref_logps"])
    assert reading.cache.hits == 1 and reading.cache.misses == 0
    with pytest.raises(CheckpointError, match="fingerprint"):  # another base (seed): another reference
        _lora_objective("adapter_off", seed=1, overrides=cache)


@pytest.mark.parametrize("overrides, named", [
    ([], "model.lora.rank"),
    ([*LORA_OVERRIDES, "model.lora.modules_to_save=[norm]"], "model.lora.modules_to_save"),
])
def test_adapter_off_without_adapters_or_with_modules_to_save_is_a_config_error(overrides, named):
    with pytest.raises(ConfigError) as info:
        load(CONFIGS / "e2e-dpo.yaml", ["objective.dpo.reference=adapter_off", *overrides])
    assert info.value.context["key"] == "objective.dpo.reference"
    assert named in str(info.value)


def test_nll_coef_adds_the_chosen_mean_nll_per_pair_and_the_ledger_has_both_log_probs():
    objective, model = _objective(fuse_head=True)
    batch = objective.prepare(_batch())
    plain = objective.loss(model, batch)
    policy = _sums(model, batch)
    layout = pair_layout(batch)
    lengths = layout.token_counts[:, 0].tolist()  # chosen response tokens of each pair
    nll = sum(-pc / n for (pc, _), n in zip(policy, lengths))
    assert float(plain.metrics["chosen_nll"]) == pytest.approx(nll, rel=1e-5)
    with_nll, same = _objective(fuse_head=True, overrides=["objective.dpo.nll_coef=3.0"])
    out = with_nll.loss(same, with_nll.prepare(_batch()))  # the same seeded weights
    assert float(out.sum.detach()) == pytest.approx(float(plain.sum.detach()) + 3.0 * nll, rel=1e-5)
    fields = objective.ledger_fields(batch, {k: float(v) for k, v in plain.metrics.items()}, plain.count)
    assert fields["chosen_logps"] == pytest.approx(sum(c for c, _ in policy) / 3, rel=1e-5)
    assert fields["rejected_logps"] == pytest.approx(sum(r for _, r in policy) / 3, rel=1e-5)


def test_nll_coef_is_checked_and_hashed_only_when_set():
    tiny_dpo = CONFIGS.parents[1] / "configs" / "tiny-dpo.yaml"
    unset = load(CONFIGS / "e2e-dpo.yaml")
    assert load(CONFIGS / "e2e-dpo.yaml", ["objective.dpo.nll_coef=0"]).hash == unset.hash  # the default
    assert load(CONFIGS / "e2e-dpo.yaml", ["objective.dpo.nll_coef=0.5"]).hash != unset.hash
    for value, loss in ((-1.0, "sigmoid"), (0.5, "orpo")):
        with pytest.raises(ConfigError) as error:
            load(tiny_dpo, [f"objective.dpo.nll_coef={value}", f"objective.dpo.loss={loss}"])
        assert "objective.dpo.nll_coef" in str(error.value)


def test_a_pairs_sums_depend_on_its_own_tokens_only_not_on_the_rows_beside_it():
    """The reference's sums are batch contents: the same pair in a micro-batch of other rows and
    more pair slots (another GPU count spreads rows differently) sums to the same bits, by one
    fixed tree over the positions (a library sum picks its order by the whole shape on CUDA)."""
    from training.objectives.dpo import sequence_sums
    from training.objectives.token_logps import pairwise_sum

    a, b, c = torch.tensor(1.0), torch.tensor(1e-8), torch.tensor(-1.0)
    assert pairwise_sum(torch.stack([a, b, c])) == (a + b) + (c + 0.0)  # the tree, padded to 4
    assert pairwise_sum(torch.zeros(2, 0)).tolist() == [0.0, 0.0]
    values = torch.randn(5, 7, 113, dtype=torch.float64)
    assert torch.allclose(pairwise_sum(values), values.sum(-1))
    generator = torch.Generator().manual_seed(3)
    token_logps = -torch.rand(6, 256, generator=generator) * 9
    segments = (torch.rand(6, 8, 256, generator=generator) > 0.6).float()
    together = sequence_sums(token_logps, segments)
    for row in range(6):
        alone = sequence_sums(token_logps[row:row + 1], segments[row:row + 1, :2])
        assert torch.equal(alone, together[row:row + 1, :2])
