"""Flow control: the one semaphore on documents in flight, and the per-stream read-ahead budget.

``InFlightLimiter`` is the single bound on memory: the source stage takes a permit per
document before reading it and the packer gives it back when the document is packed, so
however fast the source is, at most ``data.max_in_flight`` documents sit between them.
The packer never waits on anything downstream, so permits always come back: no deadlock.

``ReadAheadBudget`` decides *which* stream to read next: the live stream with the fewest
tokens ahead of the batch stage (estimated from raw bytes until packed), and none while every
stream holds its target. Which stream is read when changes only timing, never output.
"""

from __future__ import annotations

import threading

from data.pipeline.queues import Closed


class InFlightLimiter:
    """A counting semaphore whose acquire takes several permits and can be closed."""

    def __init__(self, bound: int) -> None:
        if bound <= 0:
            raise ValueError("bound must be > 0")
        self.bound = bound
        self.in_flight = 0
        self.peak = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, n: int) -> None:
        if not 0 < n <= self.bound:
            raise ValueError(f"cannot take {n} of {self.bound} permits")
        with self._cond:
            while self.in_flight + n > self.bound and not self._closed:
                self._cond.wait()
            if self._closed:
                raise Closed("in-flight limiter")
            self.in_flight += n
            self.peak = max(self.peak, self.in_flight)

    def release(self, n: int) -> None:
        if n <= 0:
            return
        with self._cond:
            if n > self.in_flight:
                raise RuntimeError(f"released {n} permits, only {self.in_flight} taken")
            self.in_flight -= n
            self._cond.notify()  # one taker: the source stage

    def available(self) -> int:
        return self.bound - self.in_flight

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ReadAheadBudget:
    """Tokens each stream holds ahead of the batch stage, and which stream to read next."""

    def __init__(self, streams: list[int], target_tokens: int) -> None:
        self.target = target_tokens
        self._level = {s: 0 for s in streams}
        self._failed: set[int] = set()
        self._bytes = 0
        self._tokens = 0
        self._cond = threading.Condition()
        self._closed = False

    def next_stream(self) -> int:
        """The live stream furthest behind; blocks while all live streams are at their target."""
        with self._cond:
            while not self._closed:
                live = [s for s in self._level if s not in self._failed and self._level[s] < self.target]
                if live:
                    return min(live, key=lambda s: (self._level[s], s))
                self._cond.wait()
            raise Closed("read-ahead budget")

    def estimate(self, raw_bytes: int) -> int:
        """Tokens that raw_bytes will likely become (learned from what was packed)."""
        return max(1, int(raw_bytes * self._ratio()))

    def room_bytes(self, stream: int) -> int:
        """Raw bytes that would bring the stream up to its target."""
        return int((self.target - self._level[stream]) / self._ratio())

    def _ratio(self) -> float:
        return self._tokens / self._bytes if self._bytes and self._tokens else 1.0

    def add(self, changes: dict[int, int]) -> None:
        """Book token changes per stream (one wake-up for all of them)."""
        with self._cond:
            wake = False
            for stream, tokens in changes.items():
                before = self._level[stream]
                self._level[stream] = after = before + tokens
                wake |= after < self.target <= before  # only a stream that drops below its target matters
            if wake:
                self._cond.notify()  # one reader: the source stage

    def observe(self, raw_bytes: int, tokens: int) -> None:
        with self._cond:
            self._bytes += raw_bytes
            self._tokens += tokens

    def fail(self, stream: int) -> None:
        with self._cond:
            self._failed.add(stream)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def levels(self) -> dict[int, int]:
        return dict(self._level)
