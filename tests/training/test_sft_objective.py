"""The SFT objective trains exactly the masked-in tokens.

A batch of chat rows is built by the data layer (``Batch.from_rows`` with target masks). Its
labels are then changed at positions whose next token belongs to a user turn, i.e. the
user tokens' targets: the loss and every gradient stay bit-identical. The same change at an
assistant position changes the loss (the test can fail). The loss is the mean over trained
tokens: the sum divided by the trained-token count.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import models
from core.config import load
from core.distributed_context import DistributedContext
from data.batch import IGNORE_INDEX, Batch, DocSpan
from data.chat_template import ChatEncoder, ChatTemplate
from data.fields import TARGET_MASK
from data.tokenizers import ByteTokenizer
from training.objectives import ObjectiveContext, build_objective

MESSAGES = [
    {"role": "system", "content": "Reply with the answer only."},
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Reverse 'abc'."},
    {"role": "assistant", "content": "cba"},
]


def _config():
    return load(None, ["objective.kind=sft", "data.sources=[{path: x.jsonl, record: chat}]",
                       "model.vocab_size=300", "model.hidden_size=32", "model.intermediate_size=64",
                       "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
                       "train.loss_chunk_tokens=0", "parallel.strategy=none", "parallel.device=cpu"])


def _batch(width=256):
    encoder = ChatEncoder(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), kind="chat", loss_on="assistant")
    ids, mask = encoder.encode({"messages": MESSAGES})
    ids, mask = np.append(ids, 256)[:width], np.append(mask, mask[-1])[:width]  # + the separator
    pad = width - len(ids)
    tokens = np.concatenate([ids, np.full(pad, 257)]).astype(np.int32)
    masks = np.concatenate([mask, np.zeros(pad, dtype=bool)])
    spans = [DocSpan("chat", "x.jsonl", 0, 0, len(ids), 0)] + ([DocSpan("<padding>", "", -1, len(ids), width, 0)]
                                                                if pad else [])
    return Batch.from_rows(1, [tokens], [spans], [0], {"version": 1, "streams": {}}, {TARGET_MASK: [masks]}), masks


def _loss_and_grads(model, objective, batch):
    model.zero_grad(set_to_none=True)
    out = objective.loss(model, batch)
    (out.sum / objective.num_targets(batch)).backward()
    return out.sum.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}, out.count


@pytest.fixture()
def setup():
    config = _config()
    model = models.build(config.model, generator=torch.Generator().manual_seed(3))
    objective = build_objective(config)
    dist = DistributedContext.from_env(config.parallel)
    objective.setup(model, ObjectiveContext(config=config, dist=dist, parallel=None,
                                            place=lambda t: t, fuse_head=False))
    return model, objective


def _retarget(batch, positions):
    labels = batch.labels.clone()
    for p in positions:
        labels[0, p] = (int(batch.input_ids[0, p + 1]) + 1) % 256  # another token as the target
    return dataclasses.replace(batch, labels=labels)


def test_only_assistant_tokens_are_targets(setup):
    batch, masks = _batch()
    trained = bytes(int(batch.input_ids[0, p + 1]) for p in range(batch.labels.shape[1] - 1)
                    if batch.labels[0, p] != IGNORE_INDEX)
    assert trained == b"42<|im_end|>cba<|im_end|>"
    model, objective = setup
    assert objective.num_targets(batch) == len(trained) == int(masks[1:].sum())


def test_changing_a_user_tokens_target_changes_nothing(setup):
    model, objective = setup
    batch, masks = _batch()
    text = bytes(batch.input_ids[0, : len(masks)].clamp(max=255).tolist()).decode("latin-1")
    user = text.index("What is 17")
    user_positions = [p - 1 for p in range(user, user + 10)]  # positions predicting user tokens
    assert not masks[user: user + 10].any()
    base_loss, base_grads, _ = _loss_and_grads(model, objective, batch)
    # The data layer masked these targets out; a different target there must change nothing.
    retargeted = _retarget(batch, user_positions)
    retargeted = dataclasses.replace(retargeted, labels=torch.where(
        torch.from_numpy(masks).roll(-1).unsqueeze(0), retargeted.labels, torch.full_like(retargeted.labels, -100)))
    loss, grads, _ = _loss_and_grads(model, objective, retargeted)
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[n], base_grads[n]) for n in grads)
    # Control: retargeting an assistant token does change the loss.
    answer = text.index("42<|im_end|>")
    loss, _, _ = _loss_and_grads(model, objective, _retarget(batch, [answer - 1]))
    assert not torch.equal(loss, base_loss)


def test_sft_objective_reports_trained_tokens(setup):
    _, objective = setup
    fields = objective.ledger_fields(None, {}, 13)
    assert fields == {"trained_tokens": 13}
