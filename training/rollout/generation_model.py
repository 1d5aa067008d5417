"""The trained model as the Sampler takes it: unwrapped here, where the wrappers were applied.

``generation_model(model)`` takes the model as the loop trains it (plain, DDP-wrapped, with
compiled or checkpointed blocks, sharded by FSDP2 / tensor parallelism, with LoRA adapters),
removes the wrappers distributed/ put around it and reads its state under canonical names
(``distributed.params.canonical_state``), and hands both to the model family's
``generation_copy`` (``ModelFamily.generation_copy``, the row of the model's ``model.arch``; Qwen's
in models/qwen/generation_copy.py), which gathers the full weights into a plain local model and
folds the adapters in. Under sharding it is a collective: call it on every rank.
"""

from __future__ import annotations

import torch

from core.exceptions import ConfigError
from core.model_families import model_family
from core.registration import import_attr
from distributed.params import canonical_state, unwrap


def generation_model(
    model: torch.nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """A plain local model of ``model``'s family with its full weights (the model itself where it
    is plain and already on ``device`` in ``dtype``; default: the parameters' own)."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if config is None:
        raise ConfigError(f"generation_model needs a model of a registered family (with its config), "
                          f"got {type(inner).__name__}")
    copy = import_attr(model_family(config.arch).generation_copy)
    return copy(inner, canonical_state(inner), device=device, dtype=dtype)
