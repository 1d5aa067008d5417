"""The one way to run the model: ``model_forward(model, batch, ...) -> ModelOutput``.

Every caller (the training step, each objective, frozen references and teachers, the
sampler's prefill and decode) runs the model through this function, and nowhere else
(tests/models/test_forward.py scans for other calls). It reads the three tensors the
model needs from ``batch`` (anything with ``input_ids``, ``position_ids`` and
``document_ids``: a data ``Batch`` or ``ModelInputs``), moves them with ``place``, calls the
model once and names what came out:

============  ==============================  =============================================
asked for     the model returns               ``ModelOutput`` field
============  ==============================  =============================================
(default)     logits (B, T, vocab)            ``logits``
hidden=True   final normed hidden (B, T, d)   ``hidden``
head=fn       ``fn(hidden, output weight)``   ``head`` (a fused loss or log-probs)
cache=c       last token's logits (B, vocab)  ``logits`` (generation: reads and extends c)
============  ==============================  =============================================

A head runs inside the model's forward, where wrappers such as FSDP hold the output
weight unsharded. ``model`` may be wrapped (DDP, FSDP2, compiled blocks): it is called, so
every wrapper's hooks run. Nothing here computes: the arithmetic is the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from models.qwen.attention import KVCache

Head = Callable[[torch.Tensor, torch.Tensor], Any]
"""(final normed hidden states (..., d), output weight (V, d)) -> anything (a loss sum, log-probs)."""


class ModelBatch(Protocol):
    """What the model reads of a batch."""

    input_ids: torch.Tensor
    position_ids: Optional[torch.Tensor]
    document_ids: Optional[torch.Tensor]


@dataclass
class ModelInputs:
    """Model inputs that do not come from a data batch (the sampler's chunks)."""

    input_ids: torch.Tensor
    """(B, T) token ids."""
    position_ids: Optional[torch.Tensor] = None
    """(B, T) positions (default 0..T-1); with a cache, also each token's cache slot."""
    document_ids: Optional[torch.Tensor] = None
    """(B, T) packed-document ids: tokens attend within their document only (default: one)."""


@dataclass
class ModelOutput:
    """What one forward gave; a field is None where it was not asked for."""

    logits: Optional[torch.Tensor] = None
    """(B, T, vocab) in the compute dtype; (B, vocab) of each row's last token with a cache."""
    hidden: Optional[torch.Tensor] = None
    """(B, T, d) final normalized hidden states."""
    head: Any = None
    """The result of the ``head`` function."""
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Losses the model adds to the objective's (e.g. a router's balance loss); none today."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Outputs of further heads (e.g. a critic's values); none today."""


def model_forward(
    model: nn.Module,
    batch: ModelBatch,
    *,
    place: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head: Head | None = None,
    hidden: bool = False,
    cache: KVCache | None = None,
) -> ModelOutput:
    """Run ``model`` on ``batch``'s ids, positions and documents, moved by ``place`` (default: as
    they are); the module docstring says what each of ``head``, ``hidden`` and ``cache`` gives."""
    if sum((head is not None, hidden, cache is not None)) > 1:
        raise ValueError("model_forward takes at most one of head, hidden and cache")
    move = place if place is not None else _as_is
    input_ids = move(batch.input_ids)
    position_ids = None if batch.position_ids is None else move(batch.position_ids)
    document_ids = None if batch.document_ids is None else move(batch.document_ids)
    # Exactly one call of the model in the whole code base: this one.
    asked = {"cache": cache} if cache is not None else {"head": _final_hidden if hidden else head}
    out = model(input_ids, position_ids=position_ids, document_ids=document_ids, **asked)
    if cache is not None:
        return ModelOutput(logits=out)  # (B, vocab)
    if hidden:
        return ModelOutput(hidden=out)
    return ModelOutput(head=out) if head is not None else ModelOutput(logits=out)


def _final_hidden(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
