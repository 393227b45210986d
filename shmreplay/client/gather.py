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
one helper thread that copies about half of them).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..errors import ReplayError
from ..wire.headers import ROWS_OFF
from ..wire.records import key_slots
from .framecopy import Stacks
from .rowcopy import stale_keys, take_slot_rows


@dataclass
class SampleBatch:
    """One sampled batch.  ``data[f]`` has shape (n, *field.shape)."""

    data: dict
    keys: np.ndarray           # uint64: generation << 32 | slot
    probabilities: np.ndarray  # float64: P(i) when drawn
    weights: np.ndarray        # float64: importance weights, max 1 over the table
    redraws: int = 0           # rows drawn again because their slot was overwritten
    # take_rows' (arrays, addresses, bytes a row, rows) of data's arrays,
    # kept while they are the same arrays (an out= batch, reused each step)
    _bytes: tuple | None = field(default=None, repr=False, compare=False)

    def outputs(self, fields) -> tuple[np.ndarray, tuple, int]:
        """(addresses, bytes a row, rows) of ``data``'s arrays of ``fields``,
        for ``rowcopy.take_slot_rows``; bytes a row -1 for an array it may
        not write (not C-contiguous, or read-only).  Kept while ``data``
        holds the same arrays (an out= batch, reused each step)."""
        arrays = [self.data[f.name] for f in fields]
        kept = self._bytes
        if kept is None or len(kept[0]) != len(arrays) or not all(map(_same, kept[0], arrays)):
            kept = self._bytes = (arrays, *_outputs(arrays))
        return kept[1:]

    @property
    def indices(self) -> np.ndarray:
        return key_slots(self.keys).astype(np.int64)

    def __len__(self) -> int:
        return self.keys.shape[0]


def new_batch(fields, n: int, addressed: bool = False) -> SampleBatch:
    """An empty batch of n rows of ``fields`` (none: keys, probabilities and
    weights only).  ``addressed`` (for a slot layout's gather): the fields'
    arrays are carved from one allocation, each at a 64-byte boundary, so
    their addresses (what ``take_slot_rows`` writes to) follow from its
    own: asking numpy for an array's address costs ~3 us, 15 us a batch of
    5 fields.  Otherwise an array each (the carving costs ~5 us more)."""
    if not (addressed and fields):
        return SampleBatch({f.name: np.empty((n, *f.shape), f.dtype) for f in fields},
                           np.empty(n, np.uint64), np.empty(n), np.empty(n))
    plan = _plans.get((id(fields), n))
    if plan is None or plan[0] is not fields:
        plan = _plans[(id(fields), n)] = _plan(fields, n)
    _, size, carve, offs, widths = plan
    base = np.empty(size, np.uint8)
    addr = base.ctypes.data
    skip = -addr % 64
    arrays = [base[skip + o:skip + o + k].view(dt).reshape(shape) for o, k, dt, shape in carve]
    # the addresses handed to the batch as what outputs() keeps for them
    kept = (arrays, offs + (addr + skip), widths, n)
    return SampleBatch({f.name: a for f, a in zip(fields, arrays)}, np.empty(n, np.uint64), np.empty(n),
                       np.empty(n), 0, kept)


# new_batch's layout of a batch, by (id of the fields tuple, rows): the
# handle passes its spec's one tuple.  Bounded: a program makes a few
_plans: dict = {}


def _plan(fields, n: int) -> tuple:
    if len(_plans) > 64:
        _plans.clear()
    carve, at = [], 0
    for f in fields:
        k = n * f.item_bytes
        carve.append((at, k, f.dtype, (n, *f.shape)))
        at = (at + k + 63) // 64 * 64
    return (fields, at + 64, carve, np.array([c[0] for c in carve], np.int64),
            tuple(f.item_bytes for f in fields))


class Rows:
    """A table's rows as mapped now, and how sampled rows are copied out of
    them: per field with ``ndarray.take`` (a field layout: each field's rows
    one contiguous array), or by ``take_slot_rows`` (a slot layout: each
    slot's fields together, so a row is one read however many fields it
    has).  Made by the table handle at each (re)bind; used by its draw
    side on the handle's thread."""

    def __init__(self, tmap):
        self.views = tmap.fields
        lo = tmap.layout
        self.stride = lo.row_stride
        # a frame table's stacked fields: rebuilt from its rings (framecopy.py)
        self.stacks = Stacks(tmap) if lo.spec.frames else None
        if self.stride:  # the rows as bytes, one row a line, and where each field lies in it
            self.src = np.ndarray((lo.spec.capacity, self.stride), np.uint8, tmap.rows.buf, ROWS_OFF)
            self._at = {f.name: (lo.field_offs[f.name] - ROWS_OFF, f.item_bytes) for f in lo.slot_fields}
            self._spans: dict = {}

    def spans(self, fields) -> tuple[np.ndarray, np.ndarray, tuple]:
        """Slot layout: (offsets in the row, widths, widths as a tuple) of ``fields``."""
        # by identity: the handle passes its spec's one tuple (hashing its
        # Fields would cost a microsecond each, every call)
        got = self._spans.get(id(fields))
        if got is None or got[0] is not fields:
            at = [self._at[f.name] for f in fields]
            got = self._spans[id(fields)] = (fields, np.array([o for o, _ in at], np.int64),
                                             np.array([w for _, w in at], np.int64), tuple(w for _, w in at))
        return got[1:]


def take_rows(src: Rows, fields, out: SampleBatch, rows: np.ndarray) -> None:
    """Copy the rows that ``out.keys[rows]`` name into ``out.data[...][rows]``
    (a frame table's stacked fields: their stacks, rebuilt from its rings)."""
    if src.stacks is not None:
        fields = src.stacks.take(fields, out, rows)
    views = src.views
    if src.stride and fields:
        offs, widths, want = src.spans(fields)
        addrs, row_bytes, nrows = out.outputs(fields)
        if row_bytes == want:
            _take_slots(src.src, out.keys, rows, offs, widths, addrs, nrows)
            return
        # an out= batch whose arrays are not writable contiguous rows of
        # these fields: numpy's way below (which says what is wrong, if anything)
    if rows.shape[0] == out.keys.shape[0]:  # every row (rows is 0..n-1): no index copy
        slots = key_slots(out.keys)
        for f in fields:
            if src.stride:  # never take() of a strided view: it copies the whole field first
                out.data[f.name][...] = views[f.name][slots]
            else:
                _take(views[f.name], slots, out.data[f.name])
    else:
        slots = key_slots(out.keys[rows])
        for f in fields:
            out.data[f.name][rows] = views[f.name][slots]


def _same(a, b) -> bool:
    return a is b


def _outputs(arrays) -> tuple[np.ndarray, tuple, int]:
    """(addresses, bytes a row, rows) of output arrays for ``take_slot_rows``;
    bytes a row -1 for an array it may not write (not C-contiguous, or
    read-only)."""
    n = min(a.shape[0] if a.ndim else 0 for a in arrays)
    row = tuple(a.nbytes // a.shape[0] if a.ndim and a.shape[0] and a.flags.c_contiguous
                and a.flags.writeable else -1 for a in arrays)
    return np.array([a.__array_interface__["data"][0] for a in arrays], np.int64), row, n


def _take_slots(src, keys, rows, offs, widths, addrs, nrows) -> None:
    n = rows.shape[0]
    if n < 2 or not parallel_gather(n * src.shape[1]):
        done = take_slot_rows(src, keys, rows, offs, widths, addrs, nrows)
    else:  # large rows: two threads, as _take (the kernel holds no GIL)
        half = _helper_share(n, n * src.shape[1])
        other = _helper().submit(take_slot_rows, src, keys, rows[:half], offs, widths, addrs, nrows)
        done = min(take_slot_rows(src, keys, rows[half:], offs, widths, addrs, nrows), other.result())
    if done < 0:
        raise ReplayError(f"a sampled row does not fit: the out= batch's arrays hold {nrows} rows "
                          f"for {keys.shape[0]} keys (give arrays of the batch's size), or the daemon "
                          "named a slot outside the table (a daemon of another build?)")


def stale_rows(gens: np.ndarray, out: SampleBatch, rows: np.ndarray | None = None) -> np.ndarray:
    """Rows of ``out`` (of ``rows`` only, if given: positions in it, the
    rows copied last) whose slot was reserved again since it was drawn (one
    kernel: numpy's mask, index and nonzero cost ~10 us for 256 keys).

    A row whose stamp held once its copy was done is whole for good: a
    writer bumps the stamp before it writes, so the copy saw none of its
    bytes.  Only rows copied since the last check need checking; a check of
    all of them again would redraw rows already whole whenever a writer
    reached their slots later (in a small table turning over fast, several
    redraw rounds per batch where one does)."""
    keys = out.keys if rows is None else out.keys[rows]
    found = np.empty(keys.shape[0], np.int64)
    found = found[:stale_keys(keys, gens, found)]
    return found if rows is None else rows[found]


# Gathering large rows on two threads: np.take releases the GIL, so each
# half copies in parallel (dqn-atari rows from /dev/shm: 14.5 -> 20.8 GB/s,
# as fast as a numba prange kernel, without numba's threading layers, which
# are process-global and not all fork- or thread-safe).  Below ~1 MiB the
# hand-off to the helper thread costs more than it saves.  On fewer than 4
# CPUs a call that waits for its batch (``sample``) splits from 4 MiB: the
# daemon answers the learner's next request, not this one, and leaves the
# cores to a gather it finds running (server/engine/idle.py), so the split
# pays there (dqn-atari's 7 MiB on 2 CPUs, sample + update: 1,353 -> 1,557
# batches/s, medians of three rounds in one compare run, 1.19x cpprb's;
# docs/performance.md, ninth pass).  A prefetch thread (``iterator.py``)
# gathers while the caller trains, and on such a box a helper would take
# the trainer's core: it splits only from 16 MiB, where the gather outlasts
# everything else many times over (r2d2-seq, 34 MiB: 181-183 batches/s with
# it against 142-149 without), and so does everyone on 4 CPUs or more.
PARALLEL_GATHER_BYTES = 1 << 20
PARALLEL_GATHER_CPUS = 4
PARALLEL_GATHER_SMALL_BOX_BYTES = 4 << 20
PARALLEL_GATHER_ANY_CPUS_BYTES = 16 << 20
_helper_pool: tuple[int, ThreadPoolExecutor] | None = None
_background = threading.local()  # .on: this thread gathers while its process trains


def gather_in_background() -> None:
    """Mark the calling thread as one that gathers while the rest of its
    process works (a prefetch thread): on a small box its gathers stay on
    one thread (``parallel_gather``)."""
    _background.on = True


def parallel_gather(nbytes: int, cpus: int | None = None) -> bool:
    """Whether a gather of ``nbytes`` is split with the helper thread (the
    CPUs are asked each time, ~1 us against a copy of >= 1 MiB: a learner
    may be pinned to fewer after it started; ``cpus``: already asked)."""
    if nbytes < PARALLEL_GATHER_BYTES:
        return False
    if nbytes >= PARALLEL_GATHER_ANY_CPUS_BYTES:
        return True
    if (len(os.sched_getaffinity(0)) if cpus is None else cpus) >= PARALLEL_GATHER_CPUS:
        return True
    return nbytes >= PARALLEL_GATHER_SMALL_BOX_BYTES and not getattr(_background, "on", False)


def gathers_wide(src: Rows, fields, n: int) -> bool:
    """Whether ``take_rows`` of n rows of ``fields`` from ``src``, in this
    thread, will copy on every CPU the process has: split with the helper
    (``parallel_gather``) on a box of at most 2.  The SAMPLE says so
    (``records.WIDE``), and the daemon then leaves the CPUs to the copy."""
    if src is None or getattr(_background, "on", False):  # not bound yet (the SAMPLE fails
        return False  # anyway), or a prefetch thread's: one thread, and no system call
    unit = src.stride if src.stride else max([f.item_bytes for f in fields], default=0)
    if n < 2 or n * unit < PARALLEL_GATHER_BYTES:  # the usual batch: no system call
        return False
    cpus = len(os.sched_getaffinity(0))
    return cpus <= 2 and parallel_gather(n * unit, cpus)


# what the caller copies while the helper thread wakes up for its part
# (~50 us at ~15 GB/s): the helper takes that much less than half
HANDOFF_BYTES = 3 << 18


def _helper_share(n: int, nbytes: int) -> int:
    """How many of ``n`` rows (``nbytes`` in all) the helper copies: half,
    less what the caller copies while the helper starts (``HANDOFF_BYTES``).
    dqn-atari's 7 MiB on 2 CPUs: 45%, 1,440-1,598 batches/s against
    1,356-1,462 with halves (four pairs; 40% was no better); r2d2-seq's
    34 MiB: 48%, where 45% ran 0.95-0.98x of halves (three pairs)."""
    return max(1, int(n * (0.5 - HANDOFF_BYTES / (2 * nbytes))))  # n >= 2: both get rows


def _helper() -> ThreadPoolExecutor:
    global _helper_pool
    if _helper_pool is None or _helper_pool[0] != os.getpid():  # threads do not survive fork
        _helper_pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="shmreplay-gather"))
    return _helper_pool[1]


def _take(src: np.ndarray, slots: np.ndarray, dst: np.ndarray) -> None:
    # the method, not np.take: the function's dispatch costs ~2 us a call,
    # as much as gathering 128 small rows (a sample of 5 fields paid 10 us)
    if slots.shape[0] < 2 or not parallel_gather(dst.nbytes):
        src.take(slots, 0, dst, "clip")
        return
    half = _helper_share(slots.shape[0], dst.nbytes)
    other = _helper().submit(src.take, slots[:half], 0, dst[:half], "clip")
    src.take(slots[half:], 0, dst[half:], "clip")
    other.result()
