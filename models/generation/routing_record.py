"""The sampler's record of each token's experts, for routing replay (models/routing_replay.py).

A model whose ``GenerationSpec`` declares ``routing`` (its sparse layers, top_k) gets caches that are
also a routing record: ``RoutingKVCache`` holds, beside the keys and values, each row's experts per
position and sparse layer, (batch + 1, slots, layers, top_k) int16 (an expert index; -1 where nothing
was written; a quarter of int64's bytes, which a long rollout batch of a deep model notices).
The model's cached forward writes a chunk's experts at the chunk's positions (``record_routing``),
as it writes their keys and values; row copies (prefill cache -> cache) carry them along. A row's
record is read back when its sample ends (``with_routing``: at the end of its group, or on the
refill schedule when the row is handed back, before its next prompt is copied in): one entry per
prompt token and sampled token, the last sampled token's -1 (it is never fed back, so no forward
routed it).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from models.generation.kv_cache import KVCache
from models.generation.protocol import GenerationSpec

RECORD = "routing"
"""The routing record's buffer name."""


class RoutingKVCache(KVCache):
    """A ``KVCache`` that also records each token's experts per sparse layer (module docstring)."""

    def __init__(self, *, routing: tuple[int, int], **cache: object) -> None:
        super().__init__(**cache)
        layers, top_k = routing
        self.register_buffer(RECORD, torch.full((self.batch + 1, self.slots, layers, top_k), -1, dtype=torch.int16,
                                                device=self.k0.device), persistent=False)
        # Written in place by the sampler's compiled decode step, as the keys and values are: one address.
        torch._dynamo.mark_static_address(self.routing)

    def tensors(self) -> list[torch.Tensor]:
        """The key and value buffers (``KVCache.tensors``), the routing record aside (rows of another width)."""
        return [t for t in super().tensors() if t is not self.routing]

    def record_routing(self, layer: int, position_ids: torch.Tensor, experts: torch.Tensor) -> None:
        """Store sparse layer ``layer``'s experts (B, T, top_k) of the tokens at position_ids (B, T)."""
        rows = torch.arange(experts.shape[0], device=experts.device)[:, None]  # (B, 1)
        self.routing[rows, position_ids, layer] = experts.to(self.routing.dtype)

    def copy_rows(self, source: KVCache, rows: torch.Tensor, source_rows: torch.Tensor | None = None) -> None:
        """``KVCache.copy_rows``, the rows' routing records too (``source`` records as well)."""
        super().copy_rows(source, rows, source_rows)
        held = source.routing[: rows.shape[0]] if source_rows is None else source.routing[source_rows]
        self.routing.index_copy_(0, rows, held)

    def with_routing(self, samples: Sequence, prompts: Sequence[Sequence[int]]) -> list:
        """``samples`` (rows 0.. of this cache, from ``prompts``) each with its row's record (``with_routing``)."""
        return with_routing(samples, prompts, self.routing[: len(samples)].cpu())


def with_routing(samples: Sequence, prompts: Sequence[Sequence[int]], records: torch.Tensor) -> list:
    """``samples`` (from ``prompts``) each with its row of ``records`` (samples, slots, layers, top_k) cut to its
    prompt + sampled tokens, the last sampled token's -1 (module docstring)."""
    out = []
    for sample, prompt, row in zip(samples, prompts, records):
        length = len(prompt) + len(sample.tokens)
        record = row[:length].clone()
        record[length - 1] = -1  # the last sampled token: never fed back
        out.append(dataclasses.replace(sample, routing=record))
    return out


def cache_for(spec: GenerationSpec, *, batch: int, slots: int) -> KVCache:
    """``KVCache.for_spec``; a ``RoutingKVCache`` where ``spec`` declares a routing to record."""
    if spec.routing is None:
        return KVCache.for_spec(spec, batch=batch, slots=slots)
    return RoutingKVCache(routing=spec.routing, num_layers=spec.num_layers, batch=batch,
                          num_kv_heads=spec.num_kv_heads, slots=slots, head_dim=spec.head_dim, device=spec.device,
                          dtype=spec.dtype)
