"""Which data each logical stream reads, and which streams each rank runs.

Stream ``s`` of ``S`` reads, in epoch ``e`` of source ``i``, every ``S``-th unit of that
source's units in an order fixed by ``(seed, i, e)``; a source with fewer units than streams
is repeated so every stream has at least one. Rank ``r`` of ``W`` runs the streams
``s = r, r + W, r + 2W, ...``. Nothing here depends on the world size except that last
line, which is why the global batches do not.

With several sources, document ``c`` of stream ``s`` comes from the source picked by a
uniform draw fixed by ``(seed, s, c)`` against the cumulative weights: a resumed stream
re-derives its choices from the counter alone.
"""

from __future__ import annotations

import bisect

from core.exceptions import ConfigError
from data import rng
from data.sources.base import Unit

_CACHED_EPOCHS = 4


def owned_streams(num_streams: int, rank: int, world_size: int) -> list[int]:
    """The streams rank ``rank`` of ``world_size`` runs, ascending."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
    if num_streams % world_size:
        raise ConfigError(
            f"data.num_streams={num_streams} is not divisible by the world size {world_size}",
            key="data.num_streams", hint="use a world size that divides data.num_streams",
        )
    return list(range(rank, num_streams, world_size))


class StreamAssignment:
    """The units each stream reads from one source, epoch by epoch."""

    def __init__(self, units: list[Unit], *, seed: int, source_index: int, num_streams: int,
                 shuffle: bool) -> None:
        self._units = units
        self._seed = seed
        self._source_index = source_index
        self.num_streams = num_streams
        self._shuffle = shuffle
        self._orders: dict[int, list[Unit]] = {}  # recent epochs' orders; streams drift apart a little

    def units(self, stream: int, epoch: int) -> list[Unit]:
        order = self._order(epoch)
        slots = max(len(order), self.num_streams)
        return [order[p % len(order)] for p in range(stream, slots, self.num_streams)]

    def _order(self, epoch: int) -> list[Unit]:
        if epoch not in self._orders:
            order = self._units
            if self._shuffle:
                order = rng.shuffled(order, self._seed, "shard-order", self._source_index, epoch)
            if len(self._orders) >= _CACHED_EPOCHS:
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return self._orders[epoch]


class Mixture:
    """The deterministic weighted choice of the source of each document."""

    def __init__(self, weights: list[float], *, seed: int) -> None:
        total = float(sum(weights))
        self._cumulative = []
        acc = 0.0
        for w in weights:
            acc += w / total
            self._cumulative.append(acc)
        self._cumulative[-1] = 1.0
        self._seed = seed

    def choose(self, stream: int, counter: int) -> int:
        if len(self._cumulative) == 1:
            return 0
        u = rng.uniform(self._seed, "mixture", stream, counter)
        return bisect.bisect_right(self._cumulative, u)
