"""The ingest actor: remote producers' chunks into a table, as one local client.

Who calls it: ``start_ingest`` a driver or actor on the replay node; the
actor's methods run one at a time (a Ray actor without concurrency), called
by ``RemoteWriter`` (writer.py) from any node.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..client.rows import check_rows
from ..errors import DaemonUnavailable, ReplayError, ReservationExpired
from ..priorities import as_priorities
from .coalesce import CHUNK_BYTES, HOLD_S, Coalescer
from .dues import Dues, check_call
from .packing import layout_id, row_dtype, unpack

# A slot lease the ingest has held this long is handed back (a flush that
# keeps nothing) before its next insert: the daemon voids a reservation no
# commit touched for reservation_timeout_s (60 s by default), which a lease
# kept across flushes, or asked ahead, may be after an idle spell or under
# slow steady traffic, and a commit into a void lease is refused
# (ReservationExpired, which the ingest also survives: the chunks go again).
LEASE_KEEP_S = 10.0

# What the ingest owes a producer (sequence numbers flushed or lost since
# its last answer) is dropped once the producer has not called for this
# long (dues.py).
FORGET_S = 600.0


class Ingest:
    """The ingest actor: one local client of the daemon, one table.

    Confirmation is batched: the client's flush (a round trip that vouches
    for every insert before it and hands back unused slot leases, four
    times a 64-row chunk's insert) runs once per ``flush_every`` chunks, or
    when a producer asks (``sync``).  A chunk is checked when it arrives;
    a small one, on a table without a rate limiter, is held and inserted
    with the others held just before that flush (coalesce.py), any other
    is inserted at once.
    Each answer carries what is owed to its producer (dues.py) and this
    incarnation's id, so a producer sees that a restart lost what it had
    not flushed."""

    def __init__(self, socket_path: str, table: str, timeout: float | None, flush_every: int = 16,
                 forget_s: float = FORGET_S, hold_s: float = HOLD_S):
        import uuid

        import shmreplay
        self.client = shmreplay.connect(socket_path, reconnect=True)
        self.client.lazy_commits = True  # bursts, a flush every few: commits need not wake the daemon
        self.table = self.client.table(table)
        self.timeout, self.flush_every = timeout, flush_every
        self.incarnation = uuid.uuid4().hex
        self.chunks = self.rows = self.flushes = self.inserts = self.packed = 0  # insert_batch calls; packed chunks
        self.insert_s = self.flush_s = 0.0  # time spent inserting (limiter waits included) and flushing
        self.dues = Dues(forget_s)
        self.leased_at = None                       # the first insert since the lease was handed back
        self.lease_asked = 0  # slots per reservation asked of the table (Table.widen_lease)
        self.order = [f.name for f in self.table.spec.fields]
        self.row = row_dtype(self.fields())  # a packed chunk's rows (packing.py), and their id:
        self.row_id = layout_id(self.row)
        self.names = frozenset(self.order)
        self.hold_s, self.coalescing = hold_s, hold_s > 0 and not self.table.spec.rate_limited  # _accept
        self.held = Coalescer()                     # small chunks to insert as one batch
        self.release_errors = 0                     # held inserts by the thread that failed (lost, re-sent)
        # Ray runs the calls one at a time; the lock keeps them apart from
        # _release_held's thread, set going by ``holding``
        self.lock, self.holding = threading.Lock(), threading.Event()
        if self.coalescing:
            threading.Thread(target=self._release_held, name="shmreplay-ingest-held", daemon=True).start()

    def insert(self, chunk: dict, priorities=None):
        """Insert one chunk (waiting for the table's limits), flush, and
        return how many rows: the plain call, for a driver that inserts now
        and then.  Raises the table's or the daemon's error."""
        with self.lock:
            self.dues.calling = None
            self._renew_lease()
            n = self._accept(chunk, priorities, None, False)
            self._flush(None, None)
            return n

    def put(self, chunk: dict, meta: list):
        """A ``RemoteWriter``'s chunk (a dict of field -> rows, or a small
        one packed: packing.py): ``meta`` is ``[priorities, producer,
        seq, sync, layout]`` (layout: a packed chunk's ``layout_id``;
        one argument: Ray serializes each argument apart, and
        a call's arguments cost the producer and this actor more CPU than
        inserting a small chunk; a list, not a tuple: Ray packs a list of
        plain values with msgpack but pickles a tuple, ~18 us more each
        way).  Checks the chunk, holds it (coalesce.py) or inserts it
        (waiting for the table's limits), flushes if ``sync`` or
        ``flush_every`` chunks wait, and returns ``[rows, acked, lost,
        incarnation]`` for that producer (its secret key: dues.py).  Raises
        the table's or the daemon's error, about this chunk or about held
        chunks whose insert this call ran (this chunk is then not accepted:
        its producer sends it again or gives up; the others are reported
        lost)."""
        priorities, producer, seq, sync, layout = meta
        check_call(producer, seq)
        packed = isinstance(chunk, np.ndarray)  # by the writer
        with self.lock:
            if packed:
                chunk = unpack(chunk, self.row, self.row_id, self.table.name, layout)
                self.packed += 1
            self.dues.calling = producer
            self._renew_lease()
            reconnects = self.client.reconnects
            n = self._accept(chunk, priorities, (producer, seq), packed)
            self.dues.accept(producer, seq)
            # a reconnect during the insert (the daemon restarted): flush now, so
            # the chunks unflushed before it are reported lost at once, not at
            # the next flush with every chunk inserted since
            if sync or self.dues.waiting >= self.flush_every or self.client.reconnects != reconnects:
                self._flush(producer, seq)
            elif self.held.full:
                self._flush(producer, seq, vouch=False)
            elif self.held.chunks and not self.holding.is_set():
                self.holding.set()
            return self._answer(producer, n)

    def _release_held(self) -> None:
        """A thread: inserts chunks held ``hold_s`` with no call to insert
        them (producers that went quiet), so a held row is sampleable within
        about 2 x ``hold_s`` plus the daemon's idle_timeout_s (lazy commits)."""
        while True:
            self.holding.wait()
            time.sleep(self.hold_s)
            with self.lock:
                if self.held.chunks and time.monotonic() - self.held.since >= self.hold_s:
                    try:
                        self._flush(None, None, vouch=False)
                    except Exception:  # their producers are told they were lost, and send them again
                        self.release_errors += 1
                if not self.held.chunks:
                    self.holding.clear()

    def _renew_lease(self) -> None:
        if self.leased_at is not None and time.monotonic() - self.leased_at > LEASE_KEEP_S:
            self._flush(None, None, keep_leases=False)  # before its lease goes stale (LEASE_KEEP_S)

    def _accept(self, chunk: dict, priorities, tag, unpacked: bool) -> int:
        """Check a chunk, then hold it (a producer's, ``tag`` (producer,
        seq), small, on a table without a rate limiter: coalesce.py) or
        insert it now, after what is held (arrival order); its rows.  A
        rate-limited table's limiter admits each chunk as it comes.
        ``unpacked``: views of a packed chunk, the table's fields already."""
        if tag is not None and self.coalescing:
            arrays, n = (list(chunk.values()), len(next(iter(chunk.values())))) if unpacked else _table_arrays(
                self.table.spec, self.names, chunk)
            nbytes = sum(a.nbytes for a in arrays)
            if nbytes <= CHUNK_BYTES:
                if priorities is not None:
                    priorities = as_priorities(priorities, n, f"a chunk for table {self.table.name!r}",
                                               self.table.spec.alpha)
                if n:
                    self.held.add(dict(zip(self.order, arrays)), priorities, nbytes, tag)
                return self._count(n)
        if self.held.chunks:
            self._flush(None, None, vouch=False)
        try:
            n = self._insert(chunk, priorities)
        except ReservationExpired:
            self._lose()  # this chunk's producer sends it again (the call raises)
            raise
        return self._count(n)

    def _count(self, n: int) -> int:
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

    def _insert(self, chunk: dict, priorities) -> int:
        t0 = time.perf_counter()
        if self.leased_at is None:
            self.leased_at = time.monotonic()
        self.table.insert_batch(chunk, priorities, timeout=self.timeout)
        self.inserts += 1
        self.insert_s += time.perf_counter() - t0
        return len(next(iter(chunk.values())))

    def sync(self, producer: str):
        """Flush now, handing the slot lease back (a producer asks when it
        is done or about to idle); ``[0, acked, lost, incarnation]``."""
        check_call(producer, 0)
        with self.lock:
            self.dues.calling = producer
            self._flush(None, None, keep_leases=False)
            return self._answer(producer, 0)

    def _answer(self, producer: str, rows: int):
        """What a producer is told: [rows, acked, lost, incarnation] (a list: see ``put``)."""
        return [rows, *self.dues.answer(producer), self.incarnation]

    def _flush(self, producer, seq, keep_leases: bool = True, vouch: bool = True) -> None:
        """Insert what is held, then (``vouch``) flush: the daemon vouches
        for every insert since the last flush.  If either fails, nothing
        since the last flush is vouched for: the current call's chunk
        (``producer``, ``seq``; None if it is not among them) is re-sent by
        its producer or refused (the call raises); the others are reported
        lost in their producers' answers and sent again."""
        t0 = time.perf_counter()
        try:
            if self._insert_held():
                vouch = True  # what went in before the restart is reported lost now, not later
            if vouch:
                # keep the slot lease: the next chunk's insert then needs no
                # reservation round trip (LEASE_KEEP_S bounds how long)
                self.client.flush(keep_leases=keep_leases)
        except Exception:
            self.dues.withdraw(producer, seq)
            self._lose()
            raise
        if not vouch:
            return
        if not keep_leases:
            self.leased_at = None
        self.flushes += 1
        self.flush_s += time.perf_counter() - t0
        self.dues.vouch()

    def _insert_held(self) -> bool:
        """Insert the held chunks, in order; True if the client reconnected
        meanwhile (the daemon restarted): then what went in before is lost,
        and the batch that met the reconnect (retried whole into the new
        daemon) and those after it are kept for this flush."""
        after = None  # tags of the chunks inserted after a reconnect
        for batch, priorities, tags in self.held.take():
            reconnects = self.client.reconnects
            self._insert(batch, priorities)
            if self.client.reconnects != reconnects:
                after = []
            if after is not None:
                after += tags
        if after is None:
            return False
        for tag in after:
            self.dues.withdraw(*tag)
        reconnects = self.client.reconnects
        try:
            self.client.flush(keep_leases=True)  # the restart's notice: inserts before it may be lost
        except DaemonUnavailable:
            pass
        except Exception:
            for tag in after:  # lost with every other unflushed chunk (_flush)
                self.dues.accept(*tag)
            raise
        self._lose()
        for tag in after:
            self.dues.accept(*tag)
        if self.client.reconnects != reconnects:
            self._lose()  # another restart during that flush: they went with the daemon they were in
        return True

    def _lose(self) -> None:
        self.held.clear()
        self.dues.lose()

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict:
        with self.lock:
            return {"chunks": self.chunks, "rows": self.rows, "flushes": self.flushes, "inserts": self.inserts,
                    "packed": self.packed, "insert_s": self.insert_s, "flush_s": self.flush_s,
                    "producers": len(self.dues.seen), "forgotten": self.dues.forgotten, "held": self.held.chunks,
                    "release_errors": self.release_errors, "producer_ids": self.dues.shown(),  # digests only
                    "node": ray.get_runtime_context().get_node_id()}

    def fields(self) -> dict:
        """The table's fields, name -> (dtype, shape): remote writers build rows to fit."""
        return {f.name: (f.dtype.str, tuple(f.shape)) for f in self.table.spec.fields}


def _table_arrays(spec, names: frozenset, chunk: dict) -> tuple[list, int]:
    """A chunk's arrays in the table's field order and dtypes (casts that
    check_rows allows: concatenated, int64 and uint64 would make float64),
    and its rows."""
    arrays, n = check_rows(spec, names, chunk, batch=True)
    return [a if a.dtype == f.dtype else a.astype(f.dtype) for a, f in zip(arrays, spec.fields)], n


def start_ingest(socket_path: str, table: str, node_id: str | None = None, name: str | None = None,
                 timeout: float | None = None, max_restarts: int = -1, flush_every: int = 16,
                 forget_s: float = FORGET_S, hold_s: float = HOLD_S):
    """An ingest actor for ``table`` of the daemon at ``socket_path``,
    pinned (``soft=False``) to ``node_id`` (default: the caller's node,
    which must be the daemon's).  ``name``: a Ray actor name, so producers
    may find it with ``ray.get_actor``; None (the default) leaves it
    unnamed, in the caller's namespace, and not detached (it goes with its
    job).  A name is listed to every job of the cluster (Ray's
    ``list_named_actors(all_namespaces=True)``): no secret, and no
    defence (docs/reliability.md, section 13).  ``timeout``: the longest
    a chunk may wait for the table's limits (None: as long as it takes;
    the producers wait with it).  ``flush_every``: chunks inserted per flush
    (a producer may ask for one sooner).  ``forget_s``: how long what is
    owed to a producer that stopped calling is kept (FORGET_S).
    ``hold_s``: the longest a small chunk waits to be inserted with others
    (coalesce.py; 0: each chunk is inserted when it comes)."""
    if not isinstance(flush_every, int) or flush_every < 1:
        raise ReplayError(f"flush_every must be an int >= 1, got {flush_every!r}")
    for what, v, hi in (("forget_s", forget_s, float("inf")), ("hold_s", hold_s, 10.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= hi:
            raise ReplayError(f"{what} must be a number of seconds in 0..{hi:g}, got {v!r}")
    node = node_id or ray.get_runtime_context().get_node_id()
    opts = dict(num_cpus=0, max_restarts=max_restarts,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
    if name is not None:
        opts["name"] = name
    return ray.remote(Ingest).options(**opts).remote(socket_path, table, timeout, flush_every, forget_s, hold_s)
