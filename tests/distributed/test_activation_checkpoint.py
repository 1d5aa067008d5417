"""Activation checkpointing recomputes exactly: same loss and bit-identical gradients."""

from __future__ import annotations

import pytest
import torch

from distributed.activation_checkpoint import apply_activation_checkpointing, blocks_to_checkpoint
from distributed.params import canonical_named_parameters
from tests.distributed.scenarios import build_model, make_batch


def _loss_and_grads(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model()
    apply_activation_checkpointing(model, mode)
    batch = make_batch(0)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in canonical_named_parameters(model)}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_grads_are_identical(mode):
    ref_loss, ref_grads = _loss_and_grads("none")
    loss, grads = _loss_and_grads(mode)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


@pytest.mark.parametrize(
    "mode, expected", [("none", []), ("full", [0, 1, 2, 3]), ("selective", [0, 2]), ("selective", [0, 2, 4])]
)
def test_which_blocks_are_recomputed(mode, expected):
    count = 4 if len(expected) != 3 else 5
    assert blocks_to_checkpoint(count, mode) == expected


def test_wrapped_blocks_replace_the_originals():
    model = build_model()
    apply_activation_checkpointing(model, "selective")
    kinds = [type(block).__name__ for block in model.layers]
    assert kinds == ["CheckpointWrapper", "QwenBlock"]
