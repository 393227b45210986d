"""The ingest's table side: one local client of the daemon, one table, the
chunks written into it.

``ChunkInserter`` owns the client and its table handle, the row layout
that packed chunks are read back in (packing.py), the small chunks held
to go in as one batch (coalesce.py), the slot lease's age and width, and
the counts the ingest's stats show.  It knows nothing of producers: what
the ingest owes them is the ingest's books (producers.py), and the ingest
(ingest.py) decides when to flush and what a failure costs whom.

Who calls it: the ingest, under its lock, one call at a time.
"""

from __future__ import annotations

import time

from ..client.rows import check_rows
from ..errors import DaemonUnavailable
from ..priorities import as_priorities
from .coalesce import CHUNK_BYTES, Coalescer
from .packing import layout_id, row_dtype, unpack

# A slot lease the ingest has held this long is handed back (a flush that
# keeps nothing) before its next insert: the daemon voids a reservation no
# commit touched for reservation_timeout_s (60 s by default), which a lease
# kept across flushes, or asked ahead, may be after an idle spell or under
# slow steady traffic, and a commit into a void lease is refused
# (ReservationExpired, which the ingest also survives: the chunks go again).
LEASE_KEEP_S = 10.0


class ChunkInserter:
    """The ingest's client and table, and the chunks it writes there (see
    the module docstring).  ``coalescing``: small chunks of producers are
    held (``hold``) to go in with the others before the next flush."""

    def __init__(self, socket_path: str, table: str, timeout: float | None, flush_every: int, hold_s: float):
        import shmreplay
        self.client = shmreplay.connect(socket_path, reconnect=True)
        self.client.lazy_commits = True  # bursts, a flush every few: commits need not wake the daemon
        self.table = self.client.table(table)
        self.timeout, self.flush_every = timeout, flush_every
        self.chunks = self.rows = self.flushes = self.inserts = self.packed = 0  # insert_batch calls; packed chunks
        self.insert_s = self.flush_s = 0.0  # time spent inserting (limiter waits included) and flushing
        self.leased_at = None                       # the first insert since the lease was handed back
        self.lease_asked = 0  # slots per reservation asked of the table (Table.widen_lease)
        self.order = [f.name for f in self.table.spec.fields]
        self.row = row_dtype(self.fields())  # a packed chunk's rows (packing.py), and their id:
        self.row_id = layout_id(self.row)
        self.names = frozenset(self.order)
        self.coalescing = hold_s > 0 and not self.table.spec.rate_limited  # hold
        self.held = Coalescer()                     # small chunks to insert as one batch

    @property
    def reconnects(self) -> int:
        """The client's reconnects so far (a daemon restart met)."""
        return self.client.reconnects

    def fields(self) -> dict:
        """The table's fields, name -> (dtype, shape): remote writers build rows to fit."""
        return {f.name: (f.dtype.str, tuple(f.shape)) for f in self.table.spec.fields}

    def unpack(self, chunk, layout) -> dict:
        """A packed chunk's rows as views, the table's fields (packing.py)."""
        chunk = unpack(chunk, self.row, self.row_id, self.table.name, layout)
        self.packed += 1
        return chunk

    def lease_stale(self) -> bool:
        """True if the slot lease has been held LEASE_KEEP_S: hand it back
        (a flush that keeps no lease) before it goes stale in the daemon."""
        return self.leased_at is not None and time.monotonic() - self.leased_at > LEASE_KEEP_S

    def hold(self, chunk: dict, priorities, tag, unpacked: bool) -> int | None:
        """Check a producer's chunk (``tag``: (producer, seq)) and hold it
        if it is small and this inserter coalesces; its rows, or None if it
        is to be inserted now (unchecked yet: ``insert_batch`` checks it).
        ``unpacked``: views of a packed chunk, the table's fields already."""
        if not self.coalescing:
            return None
        arrays, n = (list(chunk.values()), len(next(iter(chunk.values())))) if unpacked else _table_arrays(
            self.table.spec, self.names, chunk)
        nbytes = sum(a.nbytes for a in arrays)
        if nbytes > CHUNK_BYTES:
            return None
        if priorities is not None:
            priorities = as_priorities(priorities, n, f"a chunk for table {self.table.name!r}",
                                       self.table.spec.alpha)
        if n:
            self.held.add(dict(zip(self.order, arrays)), priorities, nbytes, tag)
        return self.count(n)

    def count(self, n: int) -> int:
        """Count an accepted chunk of n rows (held or inserted); n."""
        self.chunks += 1
        self.rows += n
        if n * self.flush_every > self.lease_asked:
            # a lease of flush_every chunks: one reservation (a daemon
            # wake-up) per flush, where a small table's default lease
            # (capacity/256: 78 slots of a 20,000-item one) needed one for
            # nearly every 64-row chunk
            self.lease_asked = n * self.flush_every
            self.table.widen_lease(self.lease_asked)
        return n

    def insert(self, chunk: dict, priorities) -> int:
        """Insert a chunk (or a batch of held ones), waiting for the table's limits; its rows."""
        t0 = time.perf_counter()
        if self.leased_at is None:
            self.leased_at = time.monotonic()
        self.table.insert_batch(chunk, priorities, timeout=self.timeout)
        self.inserts += 1
        self.insert_s += time.perf_counter() - t0
        return len(next(iter(chunk.values())))

    def insert_held(self) -> list | None:
        """Insert the held chunks, in order; None if the client did not
        reconnect meanwhile, else the tags of the chunks of the batch that
        met the reconnect (retried whole into the new daemon) and after it."""
        after = None  # tags of the chunks inserted after a reconnect
        for batch, priorities, tags in self.held.take():
            reconnects = self.client.reconnects
            self.insert(batch, priorities)
            if self.client.reconnects != reconnects:
                after = []
            if after is not None:
                after += tags
        return after

    def flush(self, keep_leases: bool) -> None:
        """The client's flush: the daemon vouches for every insert before it."""
        self.client.flush(keep_leases=keep_leases)

    def flushed(self, t0: float, keep_leases: bool) -> None:
        """Count a flush that began at ``t0`` (time.perf_counter) and vouched."""
        if not keep_leases:
            self.leased_at = None
        self.flushes += 1
        self.flush_s += time.perf_counter() - t0

    def notice_restart(self) -> bool:
        """After a reconnect: a flush, the restart's notice (inserts before it
        may be lost); True if the client reconnected again during it."""
        reconnects = self.client.reconnects
        try:
            self.client.flush(keep_leases=True)
        except DaemonUnavailable:
            pass
        return self.client.reconnects != reconnects

    def stats(self) -> dict:
        return {"chunks": self.chunks, "rows": self.rows, "flushes": self.flushes, "inserts": self.inserts,
                "packed": self.packed, "insert_s": self.insert_s, "flush_s": self.flush_s,
                "held": self.held.chunks}


def _table_arrays(spec, names: frozenset, chunk: dict) -> tuple[list, int]:
    """A chunk's arrays in the table's field order and dtypes (casts that
    check_rows allows: concatenated, int64 and uint64 would make float64),
    and its rows."""
    arrays, n = check_rows(spec, names, chunk, batch=True)
    return [a if a.dtype == f.dtype else a.astype(f.dtype) for a, f in zip(arrays, spec.fields)], n
