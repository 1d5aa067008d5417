"""The dpo objective's loss equals the DPO formula computed by hand from full logits, for a
tiny model on a batch of two rows holding three pairs; fused (chunked head) and logits paths
agree; cached-style ``ref_logps`` extras hold each sequence's sum at its first target token."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import models
from core import seeding
from core.config import load
from data.batch import Batch, DocSpan
from training.objectives.base import ObjectiveContext
from training.objectives.dpo import DPOObjective

T = 32


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
    return Batch.from_rows(1, tokens, spans, [0, 1], {}, masks, roles=roles)


def _objective(fuse_head: bool, loss: str = "sigmoid"):
    config = load(None, ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
                         "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
                         "parallel.strategy=none", f"objective.dpo.loss={loss}", "objective.dpo.beta=0.5",
                         "train.loss_chunk_tokens=7", "train.micro_batch_size=2"])
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
