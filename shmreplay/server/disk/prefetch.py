"""Clairvoyant prefetch: file-backed tables' rows read into the page cache
before a client touches them, and their writes started early.

The daemon knows which rows will be touched before the clients do: a
learner gathers the slots a SAMPLE drew (with ``iterate(prefetch=k)``, k
batches later), and a writer stores into the slots a RESERVE leased it.  A
page of a rows file that is not in the page cache costs whoever touches it
through the mapping a synchronous read, one fault at a time (FACTS.md:
random 28 KB rows come off this disk 3x faster 16 at a time than one at a
time).  So after each draw and reservation of a file-backed table the
engine hands the slots to the ``Prefetcher`` (``engine/commands.py``), and a pool
of reader threads has their byte ranges read.  Slots that follow each other
merge into one range, and each field's ranges are read whole pages at a time.
Two ways (docs/performance.md, "Beyond RAM", cold dqn-atari rows):

* "fadvise" (default): ``POSIX_FADV_WILLNEED`` per range, a whole batch from
  one reader; it only queues the reads, so all go to the disk at once (cold
  iterate 21,000-27,500 rows/s over the runs, above 16 threads reading a
  row each); a page-cache look-up on cached rows (12-41% of a warm
  learner's rate on 2 cores).
* "pread": ``preadv`` into a scratch buffer thrown away (the point is the
  page cache), ``threads`` readers sharing a batch (10,300-16,400 rows/s);
  warm it copies every row again and wakes a reader per few rows, which
  cost the learner 4-7x.

The same threads start the writeback of what writers stored: every
``writeback_s`` each rows file whose table took inserts since gets one
``sync_file_range(SYNC_FILE_RANGE_WRITE)`` of the whole file, which starts
writing its dirty pages now, a fraction of a second's worth at a time, not
all at once when the kernel's dirty limit makes a writer wait (in
``balance_dirty_pages``).  Being periodic, it costs a commit nothing.

The engine never waits here: it computes the ranges (a numba kernel, a few
microseconds) and appends them to a queue under a lock held for a few list
operations.  The queue is bounded (``bound`` ranges): past it the oldest
ranges are dropped and counted, since what was drawn long ago has been
gathered already; so memory stays bounded by the lookahead whatever the
table size, and a disk that cannot keep up loses prefetches, never rows.

A frame table's draw also has the frames its items reference read ahead
(``read_frames``: the daemon's references, as ranges of each ring).

Threads: ``add``, ``drop``, ``read``, ``stats`` and ``table_stats`` on the
engine thread; ``stop`` once, by the daemon after the engine has stopped.
Readers touch the queue and counters under the lock, their own scratch
buffer and a table's inserts counter (a shared-memory word), never a
mapping: a client that truncates a rows file makes reads past its end
come back short or do nothing, never the daemon fault (an I/O error is
counted in ``prefetch_errors``; ``prefetch_bytes`` counts what was asked).
A descriptor is closed outside the lock: the last close of a dropped 45 GB
file frees its page cache, which must not hold up the engine's ``read``.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time

import numpy as np

from ...wire.records import key_slots
from ...wire.rowranges import ranges_of
from .ckframes import ring_columns

log = logging.getLogger("shmreplayd.prefetch")

METHODS = ("fadvise", "pread")  # the ways of reading ahead (see above); config checks it
READ, WRITEBACK = 0, 1
SCRATCH = 256 << 10     # a reader's buffer; a longer range reuses it (preadv iovecs)
TAKE_BYTES = 64 << 10   # one reader's share of a read job: ~2 DQN rows, many small ones
SYNC_FILE_RANGE_WRITE = 2


_sync_file_range = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # Linux only
if _sync_file_range is not None:  # a CDLL call releases the GIL
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


class Job:
    """Ranges of one rows file to read, oldest first in the queue; ``pos``:
    how many were taken or dropped already."""

    __slots__ = ("src", "offs", "lens", "pos", "take")

    def __init__(self, src: "RowSource", offs: np.ndarray, lens: np.ndarray, take_bytes: int = 0):
        self.src, self.offs, self.lens, self.pos = src, offs, lens, 0
        # a reader takes about take_bytes (0: all), so that many share a batch
        n = offs.shape[0]
        self.take = max(1, take_bytes * n // max(1, int(lens.sum()))) if take_bytes else n

    @property
    def left(self) -> int:
        return self.offs.shape[0] - self.pos


SMALL_FIELD = 64 << 20  # bytes of a field's whole array: not read ahead (unless every field is)


class RowSource:
    """A file-backed table's rows file as the prefetcher sees it: its own
    duplicate of the daemon's descriptor (closed once the table is dropped
    and no reader uses it), where each field's rows lie, its counters."""

    def __init__(self, name: str, fd: int, fields: list[tuple[int, int]], words=None):
        self.name = name
        self.fd = os.dup(fd)
        self.offs = np.array([o for o, _ in fields], np.int64)
        self.widths = np.array([w for _, w in fields], np.int64)
        self.words = words  # the table's LiveWords: its inserts tell when to write back
        self.written = 0    # inserts as of the last writeback
        self.closed = False
        self.users = 0      # readers working on its ranges now; guarded by the pool's lock
        self.counts = dict.fromkeys(("prefetch_reads", "prefetch_bytes", "prefetch_dropped",
                                     "prefetch_errors", "writeback_calls"), 0)

    def dirty(self) -> bool:
        """Took inserts since the last writeback (a reader, under the lock)."""
        n = self.words.inserts if self.words is not None else self.written + 1
        if n == self.written:
            return False
        self.written = n
        return True


class Prefetcher:
    """The reader pool, one per daemon (``threads`` 0: a pool that does
    nothing); the readers start with the first file-backed table.
    Constructed and stopped by the daemon's main thread."""

    def __init__(self, threads: int = 16, bound: int = 4096, method: str = "fadvise",
                 writeback_s: float = 0.25):
        if method not in METHODS:
            raise ValueError(f"prefetch method {method!r} is not one of {METHODS}")
        self.method, self.bound, self.writeback_s = method, max(1, int(bound)), writeback_s
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.queue: collections.deque[Job] = collections.deque()
        self.queued = 0       # ranges in the queue
        self.queued_max = 0   # the most there ever were: never past bound
        self.due: collections.deque[RowSource] = collections.deque()  # writebacks, one per file at most
        self.busy = 0         # readers working on ranges they took
        self.by_table: dict[int, RowSource] = {}  # engine thread only
        self.frames_of: dict[int, tuple] = {}     # a frame table's references and rings; engine thread
        self.sources: set[RowSource] = set()      # under the lock
        self.next_writeback = 0.0
        self.stopping = False
        self.nthreads = threads
        self.threads: list[threading.Thread] = []
        if threads:  # at startup, not on the engine thread at the first table
            ranges_of(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64))

    # ---- engine thread ----
    def add(self, table) -> None:
        """A table is served: prefetch its rows if they are in a file."""
        if self.nthreads and table.spec.file_backed and table.map.rows.fd is not None:
            offs, widths = table.map.layout.row_spans()
            fields, c = list(zip(offs.tolist(), widths.tolist())), table.spec.capacity
            # a small field (actions, rewards: a few MB for the whole table)
            # stays in the page cache by use alone; reading it ahead would
            # only add a call per row, which a warm learner pays for
            big = [(o, w) for o, w in fields if c * w > SMALL_FIELD]
            try:
                src = self.source(table.spec.name, table.map.rows.fd, big or fields, table.map.words)
            except (OSError, RuntimeError) as exc:  # no descriptor or thread left: serve, unprefetched
                log.error("table %s: served without prefetch: %s", table.spec.name, exc)
                return
            self.by_table[table.id] = src
            if table.frames is not None:  # a draw's frames too, read from the daemon's references
                rings = [(r.offset, r.frame_bytes, r.frames, cols) for r, cols in
                         zip(table.map.layout.rings, ring_columns(table.spec).values())]
                self.frames_of[table.id] = (table.map.refs, rings)

    def source(self, name: str, fd: int, fields: list[tuple[int, int]], words=None) -> RowSource:
        """A rows file to prefetch from; ``fields``: (offset of its first
        row, bytes per row) of each field."""
        src = RowSource(name, fd, fields, words)
        with self.lock:
            if not self.threads and not self.stopping:
                for i in range(self.nthreads):  # each one kept as it starts: stop joins those that did
                    t = threading.Thread(target=self._reader, args=(i == 0,), daemon=True,
                                         name=f"shmreplay-prefetch-{i}")
                    t.start()
                    self.threads.append(t)
            self.sources.add(src)
            self.ready.notify_all()  # the timer reader starts its period
        return src

    def drop(self, table_id: int) -> None:  # the table is no longer served
        self.frames_of.pop(table_id, None)
        src = self.by_table.pop(table_id, None)
        if src is not None:
            self.forget(src)

    def read(self, table_id: int, slots: np.ndarray | None, keys: np.ndarray | None = None) -> None:
        """A reservation's slots or a draw's keys: their rows will be touched
        soon.  One dict look-up for a table it does not prefetch."""
        src = self.by_table.get(table_id)
        if src is not None:
            self.read_rows(src, slots if keys is None else key_slots(keys))
            if keys is not None and table_id in self.frames_of:
                self.read_frames(src, *self.frames_of[table_id], key_slots(keys))

    def read_frames(self, src: RowSource, refs: np.ndarray, rings: list, slots: np.ndarray) -> None:
        """A frame table's draw: the frames its items reference (the meta
        segment's references, which only the daemon writes), each ring's
        as ranges of frames next to each other (a stream's mostly are)."""
        held = refs[slots]
        for off, fb, nframes, cols in rings:
            frames = np.unique(held[:, cols]).astype(np.int64)
            frames = frames[frames < nframes]  # NO_REF: a slot holding none
            offs, lens = ranges_of(frames, np.array([off], np.int64), np.array([fb], np.int64))
            if offs.shape[0]:
                self.put(Job(src, offs, lens, TAKE_BYTES if self.method == "pread" else 0))

    def read_rows(self, src: RowSource, slots: np.ndarray) -> None:
        offs, lens = ranges_of(slots, src.offs, src.widths)
        if offs.shape[0]:
            # WILLNEED only queues the reads, so one reader issues a whole
            # batch; a preadv waits for its range, so many share the batch
            self.put(Job(src, offs, lens, TAKE_BYTES if self.method == "pread" else 0))

    def put(self, job: Job) -> None:
        """Queue a job; past the bound the oldest ranges go."""
        with self.lock:
            if self.stopping or job.src.closed:
                return
            self.queue.append(job)
            self.queued += job.left
            self._trim()
            self.ready.notify()

    def _trim(self) -> None:
        while self.queued > self.bound:
            head = self.queue[0]
            k = min(head.left, self.queued - self.bound)
            head.pos += k
            self.queued -= k
            head.src.counts["prefetch_dropped"] += k
            if head.left == 0:
                self.queue.popleft()
        self.queued_max = max(self.queued_max, self.queued)

    def forget(self, src: RowSource) -> None:
        """No more jobs from ``src``; its descriptor is closed now or by the
        last reader using it."""
        with self.lock:
            if src.closed:
                return
            src.closed = True
            self.sources.discard(src)
            last = src.users == 0
        if last:
            os.close(src.fd)

    def stats(self) -> dict:
        """The pool's numbers (a table's are in ``table_stats``)."""
        with self.lock:
            return {"threads": sum(t.is_alive() for t in self.threads), "method": self.method,
                    "queued": self.queued, "queued_max": self.queued_max, "bound": self.bound,
                    "busy": self.busy}

    def table_stats(self, table_id: int, src: RowSource | None = None) -> dict:
        """A table's counters ({} for a table it does not prefetch)."""
        src = src or self.by_table.get(table_id)
        if src is None:
            return {}
        with self.lock:
            return dict(src.counts)

    # ---- the daemon's main thread ----
    def stop(self, timeout: float = 10.0) -> None:
        """Once the engine has stopped: end and join the readers (a read in
        progress finishes first), close every descriptor."""
        with self.lock:
            self.stopping = True
            self.queue.clear()
            self.queued = 0
            self.ready.notify_all()
        deadline = time.monotonic() + timeout  # one for all: a stuck disk holds the stop at most this
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for src in list(self.sources):
            self.forget(src)
        self.by_table.clear()
        alive = sum(t.is_alive() for t in self.threads)
        if alive:
            log.warning("%d prefetch readers did not stop within %.0f s (a read is stuck)", alive, timeout)

    # ---- reader threads ----
    def _take(self, timer: bool):
        """(source, kind, offsets, lengths) of the next work, or None once
        stopping: a due writeback (of the whole file), else some ranges of
        the oldest job.  The ``timer`` reader also wakes for the writeback
        period; any reader finds the writebacks that are due."""
        with self.lock:
            while True:
                if self.stopping:
                    return None
                now = time.monotonic()
                if now >= self.next_writeback and self.sources:
                    self.next_writeback = now + self.writeback_s
                    self.due.extend(src for src in self.sources if src.dirty() and src not in self.due)
                if self.due:
                    src, kind, offs, lens = self.due.popleft(), WRITEBACK, [0], [0]
                elif self.queue:
                    job = self.queue[0]
                    k = min(job.take, job.left)
                    src, kind, lo = job.src, READ, job.pos
                    offs, lens = job.offs[lo:lo + k].tolist(), job.lens[lo:lo + k].tolist()
                    job.pos += k
                    self.queued -= k
                    if job.left == 0:
                        self.queue.popleft()
                else:
                    self.ready.wait(self.next_writeback - now if timer and self.sources else None)
                    continue
                if self.queue or self.due:  # one more reader for the rest: they share a batch
                    self.ready.notify()
                if src.closed:  # its table was dropped
                    continue
                src.users += 1
                self.busy += 1
                return src, kind, offs, lens

    def _done(self, src: RowSource, kind: int, n: int, nbytes: int, errors: int) -> None:
        with self.lock:
            c = src.counts
            if kind == WRITEBACK:
                c["writeback_calls"] += n
            else:
                c["prefetch_reads"] += n
                c["prefetch_bytes"] += nbytes
            c["prefetch_errors"] += errors
            src.users -= 1
            self.busy -= 1
            last = src.closed and src.users == 0
        if last:
            os.close(src.fd)

    def _reader(self, timer: bool) -> None:
        scratch = memoryview(bytearray(SCRATCH)) if self.method == "pread" else None
        while True:
            got = self._take(timer)
            if got is None:
                return
            src, kind, offs, lens = got
            nbytes = errors = 0
            try:
                for off, ln in zip(offs, lens):
                    try:
                        _apply(kind, src.fd, scratch, off, ln)
                        nbytes += ln
                    except OSError as exc:  # EIO, a file truncated under us: the client will see it
                        errors += 1
                        log.debug("table %s: prefetch of %d bytes at %d: %s", src.name, ln, off, exc)
            except Exception:  # a bug: lose these ranges, keep the reader
                log.exception("table %s: prefetch reader failed", src.name)
            finally:
                self._done(src, kind, len(offs), nbytes, errors)


def _apply(kind: int, fd: int, scratch: memoryview | None, off: int, ln: int) -> None:
    if kind == WRITEBACK:  # ln 0: to the end of the file
        if _sync_file_range is None:
            return
        if _sync_file_range(fd, off, ln, SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    elif scratch is None:
        os.posix_fadvise(fd, off, ln, os.POSIX_FADV_WILLNEED)
    else:
        _read_into(fd, scratch, off, ln)


def _read_into(fd: int, scratch: memoryview, off: int, ln: int) -> None:
    """One syscall, the scratch buffer repeated as often as the range needs."""
    full, rest = divmod(ln, len(scratch))
    bufs = [scratch] * full + ([scratch[:rest]] if rest else [])
    os.preadv(fd, bufs, off)
