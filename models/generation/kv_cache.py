"""The sampler's key/value cache: preallocated buffers indexed by position, one pair per layer.

Generation (models/generation/sampler.py) runs a model's blocks over this cache instead of a
packed batch: the model's cached forward writes each new token's keys and values into its slot
and attends over its row. The cache's shape comes from the model's ``GenerationSpec``
(models/generation/protocol.py): ``KVCache.for_spec``.
"""

from __future__ import annotations

import torch

from models.generation.nucleus import triton_available
from models.generation.protocol import GenerationSpec
from models.generation.row_copy import RowCopy, addresses
from models.generation.slot_write import write_slots


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x (B, T, n_kv, head_dim) with each head's values contiguous (a copy only where they are not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class KVCache(torch.nn.Module):
    """Preallocated keys and values, one (B, n_kv_head, slots, head_dim) buffer pair per layer.

    The cache is indexed by position: the key/value of the token at position p of row b
    lives in slot p of row b, so a row's layout never depends on the other rows of its
    batch (ragged prompts need no left padding). It is zero-initialized, and slots a row
    has not written are masked, never read: stale or padding values cannot reach a result.
    Buffers (not plain attributes) so that torch.compile and CUDA graphs see static
    addresses that the decode step updates in place.

    Values are stored in the model's compute dtype, one buffer per layer (not one stacked
    tensor), so that the compiled step updates each in place instead of rewriting a stacked
    cache.

    Each buffer has one row more than ``batch``: the scratch row (index ``batch``), which
    ``read`` never returns. A forward that must leave some rows' caches untouched (the
    sampler's chunked continuation of some episodes, ``Sampler._extend``) still runs all
    ``batch`` rows, and sends the writes of the rows it does not fill into the scratch row
    (``redirected``).

    Beside the keys and values, each row holds a position offset (``position_offsets``, (batch + 1,)
    int64, 0 unless a model sets it): what a model whose prompts carry media adds to a row's cache
    positions to get the positions its rotary embedding reads after the prompt (an M-RoPE family's
    image compresses many slots into few positions). It travels with the row's keys and values
    (``copy_rows``); a family that never sets it never reads anything but 0.
    """

    def __init__(
        self, *, num_layers: int, batch: int, num_kv_heads: int, slots: int, head_dim: int,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        shape = (batch + 1, num_kv_heads, slots, head_dim)  # + the scratch row
        for layer in range(num_layers):
            for name in (f"k{layer}", f"v{layer}"):
                self.register_buffer(name, torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("position_offsets", torch.zeros(batch + 1, device=device, dtype=torch.int64),
                             persistent=False)
        self.num_layers = num_layers
        self.batch = batch
        self._row_copies: dict[int, RowCopy] = {}  # id(source cache) -> its copy into this one (CUDA)

    @classmethod
    def for_spec(cls, spec: GenerationSpec, *, batch: int, slots: int) -> "KVCache":
        """A zeroed cache for ``batch`` rows of ``slots`` positions of a model of ``spec`` (its layers,
        key/value heads, head size, device and dtype)."""
        return cls(num_layers=spec.num_layers, batch=batch, num_kv_heads=spec.num_kv_heads, slots=slots,
                   head_dim=spec.head_dim, device=spec.device, dtype=spec.dtype)

    @property
    def slots(self) -> int:
        return self.k0.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's key and value buffer (to mark their addresses static; ``position_offsets`` aside)."""
        return [buffer for name, buffer in self.named_buffers() if name != "position_offsets"]

    def offsets(self) -> torch.Tensor:
        """(batch,) int64: each row's position offset (class docstring), the scratch row left out."""
        return self.position_offsets[: self.batch]

    def set_offsets(self, offsets: torch.Tensor) -> None:
        """Rows 0..B-1 take the position offsets ``offsets`` ((B,) int64)."""
        self.position_offsets[: offsets.shape[0]] = offsets

    def write(
        self, layer: int, position_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Store k, v (B, T, n_kv_head, head_dim) of tokens at position_ids (B, T) into their slots.

        Input row b writes cache row ``rows[b]`` ((B, 1) int64; default: row b itself). On CUDA, run
        eagerly (not traced by the compiler) with Triton and without ``rows``, one launch of
        models/generation/slot_write.py writes the same bytes as the indexed assignment below, without
        its deterministic mode's sort and whole-buffer copies.
        """
        keys, values = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        if rows is None and keys.is_cuda and not torch.compiler.is_compiling() and triton_available(keys.device):
            write_slots(keys, values, position_ids, _heads_contiguous(k.to(keys.dtype)),
                        _heads_contiguous(v.to(values.dtype)))
            return
        if rows is None:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        # Advanced indices around a slice put the indexed dims first: the target is (B, T, n_kv, hd).
        # Under autocast (Numerics.sampler_autocast) k or v may be bf16 beside an fp32 cache: widened
        # exactly, the values the exact kernel reads (it widens them to fp32 too). Else a no-op.
        keys[rows, :, position_ids] = k.to(keys.dtype)
        values[rows, :, position_ids] = v.to(values.dtype)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer, each (B, n_kv_head, slots, head_dim): the scratch row left out.

        A view of the first B rows of the buffer: the same address and strides as a (B, ...)
        tensor, so kernels see exactly what they saw before the scratch row existed.
        """
        return getattr(self, f"k{layer}")[: self.batch], getattr(self, f"v{layer}")[: self.batch]

    def copy_rows(self, source: "KVCache", rows: torch.Tensor, source_rows: torch.Tensor | None = None) -> None:
        """Copy rows of ``source`` (a cache of the same slots) into rows ``rows`` ((k,) int64): its rows
        ``source_rows`` ((k,) int64), or its first k rows.

        On CUDA with Triton, one kernel for every layer's buffers (``models/generation/row_copy.py``);
        otherwise one ``index_copy_`` per buffer (two per layer; with ``source_rows`` a gather too),
        fewer host operations than indexed assignment, deterministic under
        ``use_deterministic_algorithms`` (the rows are distinct). Either way the rows' bytes."""
        count = rows.shape[0]
        offsets = source.position_offsets
        self.position_offsets.index_copy_(0, rows, offsets[:count] if source_rows is None else offsets[source_rows])
        copy = self._row_copy(source)
        if copy is not None:
            copy(rows, torch.arange(count, device=rows.device) if source_rows is None else source_rows)
            return
        for layer in range(self.num_layers):
            for name in (f"k{layer}", f"v{layer}"):
                held = getattr(source, name)
                held = held[:count] if source_rows is None else held[source_rows]
                getattr(self, name).index_copy_(0, rows, held)

    def _row_copy(self, source: "KVCache") -> RowCopy | None:
        """The one-kernel copy from ``source`` into this cache, where it runs (built once per pair)."""
        targets, sources = self.tensors(), source.tensors()
        if not RowCopy.fits(targets + sources):
            return None
        copy = self._row_copies.get(id(source))
        if copy is None or copy.addresses != (addresses(targets), addresses(sources)):
            copy = self._row_copies[id(source)] = RowCopy(targets, sources)
        return copy

    def redirected(self, fill: torch.Tensor) -> "RedirectedKVCache":
        """This cache as seen by a forward that fills only the rows where ``fill`` ((B,) bool) is set.

        Reads are unchanged (every row attends over its own cache row); the other rows'
        writes go to the scratch row, so their caches keep what they hold.
        """
        rows = torch.arange(self.batch, device=fill.device).masked_fill(~fill, self.batch)
        return RedirectedKVCache(self, rows[:, None])


class RedirectedKVCache:
    """A KVCache whose writes from input row b land in cache row ``rows[b]`` (``KVCache.redirected``)."""

    def __init__(self, cache: KVCache, rows: torch.Tensor) -> None:
        self.cache, self.rows = cache, rows

    @property
    def slots(self) -> int:
        return self.cache.slots

    def write(self, layer: int, position_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, position_ids, k, v, rows=self.rows)

    def offsets(self) -> torch.Tensor:
        return self.cache.offsets()

    def set_offsets(self, offsets: torch.Tensor) -> None:
        self.cache.position_offsets[self.rows[:, 0]] = offsets

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.read(layer)
