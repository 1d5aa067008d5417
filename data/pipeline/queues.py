"""Closeable queues between stages.

Every blocking call here wakes up and raises ``Closed`` when the pipeline shuts down, so no
thread is left waiting on a queue nobody will touch again.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Closed(Exception):
    """The pipeline is shutting down."""


class BoundedQueue(Generic[T]):
    """A FIFO with a capacity; ``put`` blocks while it is full, ``get`` while it is empty."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.name = name
        self.capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        lock = threading.Lock()
        # Two conditions on one lock, so a put wakes one getter and a get one putter.
        self._not_empty = threading.Condition(lock)
        self._not_full = threading.Condition(lock)
        self._closed = False

    def put(self, item: T) -> None:
        with self._not_full:
            while len(self._items) >= self.capacity and not self._closed:
                self._not_full.wait()
            if self._closed:
                raise Closed(self.name)
            self._items.append(item)
            self._not_empty.notify()

    def get(self) -> T:
        with self._not_empty:
            while not self._items and not self._closed:
                self._not_empty.wait()
            if self._closed:
                raise Closed(self.name)
            item = self._items.popleft()
            self._not_full.notify()
            return item

    def close(self) -> None:
        with self._not_empty:
            self._closed = True
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def depth(self) -> int:
        return len(self._items)


class ReorderBuffer(Generic[T]):
    """Hands out each stream's chunks in sequence-number order, whatever order they arrive in.

    Items need ``stream`` and ``seq`` attributes; each stream's numbers start at 0. It never
    blocks a producer: the in-flight semaphore already bounds what can be held here.
    """

    def __init__(self, streams: list[int]) -> None:
        self._next = {s: 0 for s in streams}
        self._waiting: dict[tuple[int, int], T] = {}
        self._ready: collections.deque[T] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: T) -> None:
        with self._cond:
            if self._closed:
                raise Closed("reorder")
            self._waiting[(item.stream, item.seq)] = item
            stream = item.stream
            released = False
            while (stream, self._next[stream]) in self._waiting:
                self._ready.append(self._waiting.pop((stream, self._next[stream])))
                self._next[stream] += 1
                released = True
            if released:
                self._cond.notify()  # one consumer: the pack stage

    def get(self) -> T:
        with self._cond:
            while not self._ready and not self._closed:
                self._cond.wait()
            if self._closed:
                raise Closed("reorder")
            return self._ready.popleft()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._waiting.clear()
            self._ready.clear()
            self._cond.notify_all()

    def depth(self) -> int:
        return len(self._waiting) + len(self._ready)


class SequenceBuffers(Generic[T]):
    """Per-stream FIFOs of packed sequences between the packer and the batch stage.

    Unbounded on purpose: the packer must never wait (it releases the in-flight permits).
    The read-ahead budget keeps them short by not reading for a stream that is far ahead.
    """

    def __init__(self, streams: list[int]) -> None:
        self._items = {s: collections.deque() for s in streams}
        self._cond = threading.Condition()
        self._closed = False

    def push(self, stream: int, items: list[T]) -> None:
        if not items:
            return
        with self._cond:
            self._items[stream].extend(items)
            self._cond.notify()  # one consumer: the batch stage

    def take(self, n: int, stop: type) -> dict[int, list[T]]:
        """The next n items of every stream, waiting until all have them; a stream whose
        last item is a ``stop`` (nothing follows one) ends its list with it instead."""
        with self._cond:
            while not self._closed and not all(self._ready(q, n, stop) for q in self._items.values()):
                self._cond.wait()
            if self._closed:
                raise Closed("sequences")
            out = {}
            for stream, queue in self._items.items():
                items = out[stream] = []
                while queue and len(items) < n:
                    items.append(queue.popleft())
                    if isinstance(items[-1], stop):
                        break
            return out

    @staticmethod
    def _ready(queue: collections.deque, n: int, stop: type) -> bool:
        return len(queue) >= n or bool(queue) and isinstance(queue[-1], stop)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for q in self._items.values():
                q.clear()
            self._cond.notify_all()

    def depths(self) -> dict[int, int]:
        return {s: len(q) for s, q in self._items.items()}
