"""Gathering sampled rows out of a table segment, and the batch they land in:
plain functions over arrays, no pipe and no clock.

The daemon hands out keys, never rows: a learner copies the rows of the
sampled slots itself (``take_rows``), then re-reads each slot's generation
stamp (``stale_rows``).  A slot whose stamp moved was reserved by a writer
while the rows were being copied, so its row may be torn; the caller draws
those rows again (``draws.draw_batch`` is the one loop that does).  Stamps
are read only after the rows: a writer's reservation bumps the stamp before
the writer learns the slot.

Called from the thread that owns the table handle (and, for large rows,
one helper thread that copies half of them).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..wire.records import key_slots, stale


@dataclass
class SampleBatch:
    """One sampled batch.  ``data[f]`` has shape (n, *field.shape)."""

    data: dict
    keys: np.ndarray           # uint64: generation << 32 | slot
    probabilities: np.ndarray  # float64: P(i) when drawn
    weights: np.ndarray        # float64: importance weights, max 1 over the table
    redraws: int = 0           # rows drawn again because their slot was overwritten

    @property
    def indices(self) -> np.ndarray:
        return key_slots(self.keys).astype(np.int64)

    def __len__(self) -> int:
        return self.keys.shape[0]


def new_batch(fields, n: int) -> SampleBatch:
    """An empty batch of n rows of ``fields`` (none: keys, probabilities and weights only)."""
    return SampleBatch({f.name: np.empty((n, *f.shape), f.dtype) for f in fields},
                       np.empty(n, np.uint64), np.empty(n), np.empty(n))


def take_rows(views: dict, fields, out: SampleBatch, rows: np.ndarray) -> None:
    """Copy the rows that ``out.keys[rows]`` name into ``out.data[...][rows]``."""
    if rows.shape[0] == out.keys.shape[0]:  # every row (rows is 0..n-1): no index copy
        slots = key_slots(out.keys)
        for f in fields:
            _take(views[f.name], slots, out.data[f.name])
    else:
        slots = key_slots(out.keys[rows])
        for f in fields:
            out.data[f.name][rows] = views[f.name][slots]


def stale_rows(gens: np.ndarray, out: SampleBatch) -> np.ndarray:
    """Rows of ``out`` whose slot was reserved again since it was drawn."""
    return stale(out.keys, gens).nonzero()[0]  # np.flatnonzero's dispatch costs ~3 us more


# Gathering large rows on two threads: np.take releases the GIL, so each
# half copies in parallel (dqn-atari rows from /dev/shm: 14.5 -> 20.8 GB/s,
# as fast as a numba prange kernel, without numba's threading layers, which
# are process-global and not all fork- or thread-safe).  Below ~1 MiB the
# hand-off to the helper thread costs more than it saves.
PARALLEL_GATHER_BYTES = 1 << 20
_helper_pool: tuple[int, ThreadPoolExecutor] | None = None


def _helper() -> ThreadPoolExecutor:
    global _helper_pool
    if _helper_pool is None or _helper_pool[0] != os.getpid():  # threads do not survive fork
        _helper_pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="shmreplay-gather"))
    return _helper_pool[1]


def _take(src: np.ndarray, slots: np.ndarray, dst: np.ndarray) -> None:
    # the method, not np.take: the function's dispatch costs ~2 us a call,
    # as much as gathering 128 small rows (a sample of 5 fields paid 10 us)
    if dst.nbytes < PARALLEL_GATHER_BYTES:
        src.take(slots, 0, dst, "clip")
        return
    half = slots.shape[0] // 2
    other = _helper().submit(src.take, slots[:half], 0, dst[:half], "clip")
    src.take(slots[half:], 0, dst[half:], "clip")
    other.result()
