"""What a model family's weight adapter answers: where each Hugging Face tensor goes in our model,
and what each of ours is called there (``ModelFamily.weights``; Qwen's: models/qwen/weights.py).

models/hf_weights.py loads and saves every family through it. A key maps one-to-one (a rename:
Qwen's ``model.layers.0.mlp.up_proj.weight`` is our ``layers.0.mlp.up_proj.weight``) or
many-to-one: a *stacked* tensor of ours (per-expert weights, ``(experts, rows, columns)``) is
one Hugging Face tensor per slot along dim 0, whose names differ by the slot's number. The loader
fills each slot from its own file entry and refuses a missing one; the exporter writes each slot
under its own name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Slot:
    """Where one Hugging Face tensor goes in our state dict."""

    key: str
    """Our state-dict key (the plain model's canonical name)."""
    index: int | None = None
    """None: the whole tensor (one-to-one); i: slot i along dim 0 of a stacked tensor (many-to-one)."""


class WeightAdapter(Protocol):
    """A family's mapping between Hugging Face checkpoints and its model's state dict."""

    def from_hf(self, hf_key: str) -> Slot | None:
        """Where the Hugging Face tensor ``hf_key`` goes; None: it has no place in our model (the
        loader then asks ``ignored`` and ``zero_padding`` before refusing it)."""
        ...

    def to_hf(self, key: str, slots: int | None = None) -> tuple[str, ...]:
        """The Hugging Face names of our tensor ``key``: one (``slots`` None), or one per slot of a
        stacked tensor with ``slots`` entries along dim 0, in order."""
        ...

    def stacked(self, key: str) -> bool:
        """Whether our tensor ``key`` stacks several Hugging Face tensors along dim 0."""
        ...

    def ignored(self, hf_key: str) -> bool:
        """A Hugging Face tensor the loader skips (one we recompute, one another reader takes)."""
        ...

    def zero_padding(self, hf_key: str) -> bool:
        """A Hugging Face tensor our model lacks that is accepted only if all zeros (a bias we do not have)."""
        ...

    def export_padding(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Tensors an export adds so the Hugging Face class computes our function (all-zero biases)."""
        ...
