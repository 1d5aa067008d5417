"""The same pipeline without threads: the reference for tests and the benchmark's naive loop.

It reads, transforms, packs and batches with the components of a ``DataPlan`` in one
thread, one stream at a time, so anything the threaded pipeline adds (queues, workers,
reordering, back-pressure) can be checked against it and timed against it.
"""

from __future__ import annotations

from typing import Iterator, Optional

from data.batch import Batch
from data.pipeline.packing import PackedSequence, StreamFailure
from data.pipeline.items import Chunk
from data.pipeline.plan import DataPlan
from data.state import StreamState, select_streams

_CHUNK_DOCS = 32
_CHUNK_BYTES = 256 * 1024


def iterate_serial(plan: DataPlan, state: Optional[dict] = None) -> Iterator[Batch]:
    """Batches exactly as DataPipeline yields them, computed inline."""
    states: dict[int, StreamState] = (
        select_streams(state, plan.owned, plan.compat) if state is not None
        else {s: plan.fresh_state() for s in plan.owned}
    )
    step = plan.start_step(states)
    readers = {s: plan.reader(s, st) for s, st in states.items()}
    packers = {s: plan.packer(s, st) for s, st in states.items()}
    pending: dict[int, list[PackedSequence]] = {s: [] for s in plan.owned}
    assembler = plan.assembler()
    try:
        while True:
            for s in plan.owned:
                while len(pending[s]) < plan.rows_per_stream:
                    chunk = Chunk(s, 0, readers[s].read(_CHUNK_DOCS, _CHUNK_BYTES))
                    for stage in plan.stages:
                        chunk = stage.process(chunk)
                    for item in packers[s].accept(chunk.docs):
                        if isinstance(item, StreamFailure):
                            raise item.error
                        pending[s].append(item)
            rows = {s: pending[s][: plan.rows_per_stream] for s in plan.owned}
            pending = {s: pending[s][plan.rows_per_stream:] for s in plan.owned}
            step += 1
            yield assembler.assemble(step, rows)
    finally:
        for reader in readers.values():
            reader.close()
