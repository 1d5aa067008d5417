"""What the generation engine needs of a model: ``GenerationModel``, a small protocol.

The sampler (models/generation/sampler.py) runs any model family whose model class implements
it, and names none: it asks the model for its ``GenerationSpec`` (the vocabulary and the shape,
device and dtype of its key/value cache, ``KVCache.for_spec``), reads its ``Numerics`` (the
cached attention's and the sampling rule's kernels: the same object the training forward runs
under, models/numerics.py) and calls it through ``models.model_forward`` with a ``cache``. What a
family's model implements for it is declared once, in ``models.forward.FamilyModel``; a
``GenerationModel`` is such a model, plain and unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from core.exceptions import ConfigError
from models.forward import FamilyModel


@dataclass(frozen=True)
class GenerationSpec:
    """A model's shape as generation sees it."""

    vocab_size: int
    """Token ids the model reads and scores: 0..vocab_size-1."""
    num_layers: int
    """Layers, each with one key and one value buffer in the cache."""
    num_kv_heads: int
    """Key/value heads per layer (the whole model's: the sampler's copy is never sharded)."""
    head_dim: int
    """Width of one key or value head."""
    device: torch.device
    """Where the model's parameters, and so its cache and every forward, live."""
    dtype: torch.dtype
    """The model's compute dtype, which its cache stores keys and values in."""
    never_sampled: tuple[int, ...] = ()
    """Token ids the model reads but the sampler never draws (an image family's placeholders, which only
    a prompt's media fill); the log-probs it reports stay the model's, over the whole vocabulary."""
    routing: tuple[int, int] | None = None
    """(layers, top_k) of the routing the sampler records per token for replay (models/routing_replay.py); None: none."""


@runtime_checkable
class GenerationModel(FamilyModel, Protocol):
    """A family's model (``FamilyModel``: its numerics, generation spec and forward), plain and
    unsharded, which the sampler can run.

    ``model_forward(model, inputs, cache=cache)`` gives each row's last-token logits (B, vocab)
    and writes the chunk's keys/values into ``cache`` (a ``KVCache`` of ``generation_spec()``'s
    shape) at the chunk's positions, attending over slots 0..position of the row.

    A family whose prompts may carry media (images) also implements
    ``prompt_media(input_ids, lengths, media) -> context``: ``input_ids`` (B, T) a prefill group's
    whole prompts (zero-padded; ``lengths`` (B,) their lengths), ``media`` their media as
    ``Batch.media`` holds them (per field, per row its items). It reads the media once (a vision
    tower, say) and returns what each prefill chunk's cached forward then takes as ``media``; that
    forward sets the cache rows' position offsets (``KVCache.set_offsets``) where the prompt moves
    the positions after it, and every cached forward without media adds a row's offset to its
    positions. A family without it is given text prompts only.
    """

    def __call__(self, input_ids: torch.Tensor, **inputs: Any) -> Any:
        """The forward ``models.model_forward`` calls (with ``cache=`` for generation)."""
        ...


def check_plain(model: Any) -> GenerationSpec:
    """``model``'s spec, where it is a plain local ``GenerationModel``; a ConfigError otherwise.

    Its own class must implement the protocol (a wrapper around a model forwards attributes but
    is no generation model) and no parameter may be a shard of a distributed tensor.
    """
    from torch.distributed.tensor import DTensor

    implemented = callable(getattr(type(model), "generation_spec", None)) and hasattr(model, "numerics")
    if not implemented or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError(
            f"Sampler needs a plain, unsharded generation model, got {type(model).__name__}",
            hint="pass a plain local copy (training/rollout/generation_model.py makes one of a wrapped or sharded model)",
        )
    return model.generation_spec()
