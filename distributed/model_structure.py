"""What parallelize needs to know about a model's structure, duck-typed.

distributed/ may not import models/, so the transformer is recognised by attribute names
(the Qwen layout): ``model.layers`` is an ``nn.ModuleList`` of blocks, each with
``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj`` linears; ``embed_tokens``,
``norm`` and ``lm_head`` (possibly tied to ``embed_tokens``) sit on the root.
"""

from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's ``layers`` list; per-block wrappers are written back into it."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no nn.ModuleList 'layers'; parallelize expects the "
            "Qwen layout (model.layers[i].self_attn / .mlp)"
        )
    return layers


def has_tied_embeddings(model: nn.Module) -> bool:
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    return embed is not None and head is not None and head.weight is embed.weight
