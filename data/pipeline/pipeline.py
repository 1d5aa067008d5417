"""The threaded data pipeline one rank iterates: ``build(...)`` -> ``DataPipeline``.

::

    source thread: read -> light stages      (decode, byte tokenize, augment)
        -> [heavy stage on data.workers workers]  (e.g. BPE tokenize; processes if it holds the GIL)
        -> reorder -> pack thread -> per-stream sequences -> batch (in next(), on the caller's thread)

Stages are independent components; the pipeline places each one by what it costs. A light
stage (C-speed work per byte) runs inline in the thread that already holds the chunk,
because a hand-off between Python threads costs more than the work (measured); a heavy one
gets its own queue and ``data.workers`` worker threads, each handing chunks to a worker
process when the stage holds the GIL. Workers finish chunks in any order; the reorder
buffer restores each stream's order before the stateful pack stage, so the output never
depends on worker count or timing. The batch stage runs on the trainer's thread inside
``next()``: it is cheap, and a thread hand-off per batch was the largest overhead measured.

Flow control: the in-flight semaphore bounds the documents between the source and the
packer; the read-ahead budget stops reading for a stream that holds ``prefetch_batches``
batches' worth of sequences (at least READ_AHEAD_SEQUENCES) ahead of the trainer.

A bad record travels in order and surfaces from ``next()`` at the batch that needs it (or is
skipped, and counted once, when the first batch that reads past it is returned); any other failure in a thread closes the pipeline and is raised from
the next ``next()``. ``close()`` joins every thread and worker process.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Callable, Optional

from core.config import DataConfig
from core.exceptions import DataError
from data.batch import Batch
from data.pipeline.backpressure import InFlightLimiter, ReadAheadBudget
from data.pipeline.items import Chunk
from data.pipeline.packing import BadRecordKey, StreamFailure
from data.pipeline.plan import DataPlan, make_plan
from data.pipeline.procpool import ProcessPool
from data.pipeline.queues import BoundedQueue, Closed, ReorderBuffer, SequenceBuffers
from data.pipeline.stages import Stage
from data.state import StreamState, select_streams, state_dict

CHUNK_DOCS = 256
"""Most documents per chunk (the unit of hand-off between threads and processes); CHUNK_BYTES
usually ends a chunk of long documents first, while short ones (chat records of a few hundred
bytes) need many per chunk, or the per-chunk hand-off costs the trainer's process more GIL
time than the work is worth."""
IN_FLIGHT_CHUNKS = 4
"""A chunk takes at most 1/IN_FLIGHT_CHUNKS of data.max_in_flight, so several are in flight."""
CHUNK_BYTES = 256 * 1024
"""A chunk stops growing once it holds this many raw bytes."""
READ_AHEAD_SEQUENCES = 64
"""A stream reads ahead at least this many sequences' worth of tokens (plus what is in flight)."""
_JOIN_TIMEOUT_S = 30.0


class _BusyClock:
    """Seconds a stage spent working, summed over its threads."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds


class DataPipeline:
    """Iterator of this rank's Batches; see the module docstring."""

    def __init__(self, plan: DataPlan) -> None:
        self._plan = plan
        self._states: dict[int, StreamState] = {s: plan.fresh_state() for s in plan.owned}
        self._state = state_dict(self._states, plan.compat)  # after the last batch returned
        self._step = 0
        self._started = False
        self._closed = False
        self._error: Optional[BaseException] = None
        self._error_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pool: Optional[ProcessPool] = None
        self._queues: list[BoundedQueue] = []
        self._docs_read = 0
        self._skipped: set[BadRecordKey] = set()  # distinct bad records the returned batches skipped
        self._light, self._heavy = _placement(plan.stages, plan.config.workers)
        self._busy = {name: _BusyClock() for name in ["source", *(s.name for s in plan.stages), "pack", "batch"]}

    # ------------------------------------------------------------------ trainer-facing API

    def state_dict(self) -> dict:
        """This rank's stream states after the last batch next() returned."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state (merged from any world size); before the first next()."""
        if self._started:
            raise DataError("load_state_dict after iteration started",
                            hint="restore the data state before the first next()")
        states = select_streams(state, self._plan.owned, self._plan.compat)
        self._step = self._plan.start_step(states)
        self._states = states
        self._state = state_dict(states, self._plan.compat)

    def __iter__(self) -> "DataPipeline":
        return self

    def __next__(self) -> Batch:
        """The batch stage: the next rows of every stream this rank runs, as one Batch."""
        if self._closed:
            raise self._error or DataError("the data pipeline is closed", hint="build a new one")
        if not self._started:
            self._start()
        plan = self._plan
        try:
            rows = self._sequences.take(plan.rows_per_stream, StreamFailure)
        except Closed:
            self.close()
            raise self._error or DataError("the data pipeline was closed while waiting for a batch")
        t0 = time.perf_counter()
        failures = [rows[s][-1] for s in plan.owned if isinstance(rows[s][-1], StreamFailure)]
        if failures:  # the first stream, in stream order, that cannot go on
            self._record_error(failures[0].error)
            self.close()
            raise failures[0].error
        self._budget.add({s: -plan.rows_per_stream * plan.seq_len for s in plan.owned})
        for s in plan.owned:
            for row in rows[s]:
                self._skipped.update(row.skipped)
        self._step += 1
        batch = self._assembler.assemble(self._step, rows)
        self._state = batch.state
        self._busy["batch"].add(time.perf_counter() - t0)
        return batch

    def stats(self) -> dict:
        """Queue depths, in-flight documents, busy seconds per stage, counts (for the watchdog)."""
        started = self._started
        return {
            "started": started,
            "closed": self._closed,
            "step": self._step,
            "streams": list(self._plan.owned),
            "workers": self._plan.config.workers,
            "placement": {s.name: p for s, p in self._placements().items()},
            "worker_processes": len(self._pool.pids()) if self._pool else 0,
            "in_flight": self._limiter.in_flight if started else 0,
            "in_flight_bound": self._plan.config.max_in_flight,
            "in_flight_peak": self._limiter.peak if started else 0,
            "queues": self._queue_depths() if started else {},
            "read_ahead_tokens": self._budget.levels() if started else {},
            "busy_s": {name: round(clock.seconds, 6) for name, clock in self._busy.items()},
            "docs_read": self._docs_read,
            "tokens_packed": sum(p.tokens for p in self._packers.values()) if started else 0,
            # Distinct bad records in what the batches returned so far consumed: never those of
            # rows read ahead (timing), once however often a record is read (epochs, streams).
            "bad_records_skipped": len(self._skipped),
            **(self._whole_doc_counts() if started and self._plan.whole_documents else {}),
            "error": str(self._error) if self._error else None,
        }

    def skipped_records(self) -> frozenset:
        """The distinct bad records the returned batches skipped (``bad_records_skipped`` counts
        them): a rank's set, which the loop unites over ranks, since ranks may read one file."""
        return frozenset(self._skipped)

    def _whole_doc_counts(self) -> dict:
        """Whole-document packing: overlong documents truncated/dropped, padding tokens."""
        packers = self._packers.values()
        return {
            "overlong_truncated": sum(p.truncated for p in packers),
            "overlong_dropped": sum(p.dropped for p in packers),
            "padding_tokens": sum(p.padding for p in packers),
        }

    def close(self) -> None:
        """Stop every thread and worker process and wait for them; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        self._stop_all()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(_JOIN_TIMEOUT_S)
        for reader in self._readers.values():
            reader.close()

    def __enter__(self) -> "DataPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ wiring

    def _start(self) -> None:
        plan, cfg = self._plan, self._plan.config
        self._started = True
        self._readers = {s: plan.reader(s, st) for s, st in self._states.items()}
        self._packers = {s: plan.packer(s, st) for s, st in self._states.items()}
        self._assembler = plan.assembler()
        self._next_seq = {s: 0 for s in plan.owned}
        self._limiter = InFlightLimiter(cfg.max_in_flight)
        self._budget = ReadAheadBudget(plan.owned, read_ahead_tokens(plan))
        self._reorder: ReorderBuffer[Chunk] = ReorderBuffer(plan.owned)
        self._sequences = SequenceBuffers(plan.owned)
        remote = [lead for lead, _ in self._heavy if lead.holds_gil and cfg.process_pool]
        if remote:
            self._pool = ProcessPool(cfg.workers, {s.name: s for s in remote})
        self._queues = [BoundedQueue(lead.name, cfg.max_in_flight) for lead, _ in self._heavy]
        emits = [q.put for q in self._queues] + [self._reorder.put]
        self._spawn("source", lambda: self._run_source(emits[0]))
        for i, (lead, followers) in enumerate(self._heavy):
            for w in range(cfg.workers):
                self._spawn(f"{lead.name}-{w}", lambda i=i, lead=lead, followers=followers:
                            self._run_workers(lead, followers, self._queues[i], emits[i + 1]))
        self._spawn("pack", self._run_pack)

    def _placements(self) -> dict[Stage, str]:
        out = {s: "source thread" for s in self._light}
        for lead, followers in self._heavy:
            where = "processes" if lead.holds_gil and self._plan.config.process_pool else "threads"
            out[lead] = f"{self._plan.config.workers} worker {where}"
            out.update({s: f"{lead.name} workers" for s in followers})
        return out

    def _spawn(self, name: str, body: Callable[[], None]) -> None:
        thread = threading.Thread(target=self._guard, args=(body,), name=f"lockstep-data-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except Closed:
            pass
        except BaseException as exc:  # any failure in a thread reaches the trainer
            if self._closed:
                return  # close() is tearing things down; what fails now is a consequence
            if not isinstance(exc, DataError):
                exc = DataError(f"data pipeline thread {threading.current_thread().name} failed: {exc!r}",
                                hint="this is a bug in the data pipeline; report it")
            self._record_error(exc)
            self._stop_all()

    def _record_error(self, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = exc

    def _stop_all(self) -> None:
        """Wake every blocked thread with Closed, and end the worker processes."""
        for closeable in (self._limiter, self._budget, self._sequences, self._reorder, *self._queues):
            closeable.close()
        if self._pool is not None:
            self._pool.close()

    # ------------------------------------------------------------------ thread bodies

    def _run_source(self, emit: Callable[[Chunk], None]) -> None:
        chunk_docs = max(1, min(CHUNK_DOCS, self._plan.config.max_in_flight // IN_FLIGHT_CHUNKS))
        clock = self._busy["source"]
        while True:
            stream = self._budget.next_stream()
            self._limiter.acquire(chunk_docs)
            t0 = time.perf_counter()
            room = self._budget.room_bytes(stream)  # do not overshoot the target by a whole chunk
            docs = self._readers[stream].read(chunk_docs, max(1, min(CHUNK_BYTES, room)))
            self._limiter.release(chunk_docs - len(docs))
            chunk = Chunk(stream, self._next_seq[stream], docs,
                          self._budget.estimate(sum(d.raw_bytes for d in docs)))
            self._next_seq[stream] += 1
            self._docs_read += len(docs)
            self._budget.add({stream: chunk.estimate})
            t1 = time.perf_counter()
            chunk = self._timed(self._light, chunk)
            clock.add(t1 - t0)
            emit(chunk)

    def _run_workers(self, lead: Stage, followers: list[Stage], inbox: BoundedQueue,
                     emit: Callable[[Chunk], None]) -> None:
        remote = self._pool is not None and lead.holds_gil
        clock = self._busy[lead.name]
        while True:
            chunk = inbox.get()
            t0 = time.perf_counter()
            chunk = self._pool.run(lead.name, chunk) if remote else lead.process(chunk)
            clock.add(time.perf_counter() - t0)
            emit(self._timed(followers, chunk))

    def _timed(self, stages: list[Stage], chunk: Chunk) -> Chunk:
        for stage in stages:
            t0 = time.perf_counter()
            chunk = stage.process(chunk)
            self._busy[stage.name].add(time.perf_counter() - t0)
        return chunk

    def _run_pack(self) -> None:
        clock = self._busy["pack"]
        while True:
            chunk = self._reorder.get()
            t0 = time.perf_counter()
            packer = self._packers[chunk.stream]
            tokens_before = packer.tokens
            items = packer.accept(chunk.docs)
            self._limiter.release(len(chunk.docs))
            added = packer.tokens - tokens_before
            self._budget.observe(sum(d.raw_bytes for d in chunk.docs), added)
            self._budget.add({chunk.stream: added - chunk.estimate})
            if packer.failed:
                self._budget.fail(chunk.stream)
            clock.add(time.perf_counter() - t0)
            self._sequences.push(chunk.stream, items)

    def _queue_depths(self) -> dict:
        depths = {q.name: q.depth() for q in self._queues}
        depths["reorder"] = self._reorder.depth()
        depths["sequences"] = self._sequences.depths()
        return depths


def _placement(stages: list[Stage], workers: int) -> tuple[list[Stage], list[tuple[Stage, list[Stage]]]]:
    """(light stages run by the source thread, [(heavy stage, light stages after it)])."""
    light: list[Stage] = []
    heavy: list[tuple[Stage, list[Stage]]] = []
    for stage in stages:
        if stage.heavy and workers > 0:
            heavy.append((stage, []))
        elif heavy:
            heavy[-1][1].append(stage)
        else:
            light.append(stage)
    return light, heavy


def read_ahead_tokens(plan: DataPlan) -> int:
    """Tokens each stream may hold ahead of the trainer (not counting documents in flight)."""
    batches = max(1, plan.config.prefetch_batches)
    return plan.seq_len * max(batches * plan.rows_per_stream, READ_AHEAD_SEQUENCES)


def build(config: DataConfig, *, seed: int, global_batch_size: int, rank: int, world_size: int,
          split: str = "train", record_fields: tuple[str, ...] = ()) -> DataPipeline:
    """This rank's pipeline. Raises DataError for bad data paths, ConfigError for bad shapes.
    ``record_fields``: what the objective reads of the records beside the tokens (plan.make_plan)."""
    return DataPipeline(make_plan(config, seed=seed, global_batch_size=global_batch_size,
                                  rank=rank, world_size=world_size, split=split, record_fields=record_fields))
