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

from ..errors import ReplayError, ReservationExpired
from .coalesce import HOLD_S
from .inserter import ChunkInserter
from .producers import ProducerBooks, check_call

# What the ingest owes a producer (sequence numbers flushed or lost since
# its last answer) is dropped once the producer has not called for this
# long (producers.py).
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
    Each answer carries what is owed to its producer (producers.py) and this
    incarnation's id, so a producer sees that a restart lost what it had
    not flushed.

    Composed of its books (``producers``, producers.py: what it owes each
    producer, and its incarnation) and its table side (``inserter``,
    inserter.py: the client, the table, the held chunks, the lease); it
    runs the calls and decides what a failed insert or flush costs whom."""

    def __init__(self, socket_path: str, table: str, timeout: float | None, flush_every: int = 16,
                 forget_s: float = FORGET_S, hold_s: float = HOLD_S):
        self.inserter = ChunkInserter(socket_path, table, timeout, flush_every, hold_s)
        self.flush_every, self.hold_s = flush_every, hold_s
        self.producers = ProducerBooks(forget_s)
        self.release_errors = 0  # held inserts by the thread that failed (lost, re-sent)
        # Ray runs the calls one at a time; the lock keeps them apart from
        # _release_held's thread, set going by ``holding``
        self.lock, self.holding = threading.Lock(), threading.Event()
        if self.inserter.coalescing:
            threading.Thread(target=self._release_held, name="shmreplay-ingest-held", daemon=True).start()

    def insert(self, chunk: dict, priorities=None):
        """Insert one chunk (waiting for the table's limits), flush, and
        return how many rows: the plain call, for a driver that inserts now
        and then.  Raises the table's or the daemon's error."""
        with self.lock:
            self.producers.calling = None
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
        incarnation]`` for that producer (its secret key: producers.py).  Raises
        the table's or the daemon's error, about this chunk or about held
        chunks whose insert this call ran (this chunk is then not accepted:
        its producer sends it again or gives up; the others are reported
        lost)."""
        priorities, producer, seq, sync, layout = meta
        check_call(producer, seq)
        packed = isinstance(chunk, np.ndarray)  # by the writer
        inserter = self.inserter
        with self.lock:
            if packed:
                chunk = inserter.unpack(chunk, layout)
            self.producers.calling = producer
            self._renew_lease()
            reconnects = inserter.reconnects
            n = self._accept(chunk, priorities, (producer, seq), packed)
            self.producers.accept(producer, seq)
            # a reconnect during the insert (the daemon restarted): flush now, so
            # the chunks unflushed before it are reported lost at once, not at
            # the next flush with every chunk inserted since
            if sync or self.producers.waiting >= self.flush_every or inserter.reconnects != reconnects:
                self._flush(producer, seq)
            elif inserter.held.full:
                self._flush(producer, seq, vouch=False)
            elif inserter.held.chunks and not self.holding.is_set():
                self.holding.set()
            return self.producers.answer(producer, n)

    def _release_held(self) -> None:
        """A thread: inserts chunks held ``hold_s`` with no call to insert
        them (producers that went quiet), so a held row is sampleable within
        about 2 x ``hold_s`` plus the daemon's idle_timeout_s (lazy commits)."""
        held = self.inserter.held
        while True:
            self.holding.wait()
            time.sleep(self.hold_s)
            with self.lock:
                if held.chunks and time.monotonic() - held.since >= self.hold_s:
                    try:
                        self._flush(None, None, vouch=False)
                    except Exception:  # their producers are told they were lost, and send them again
                        self.release_errors += 1
                if not held.chunks:
                    self.holding.clear()

    def _renew_lease(self) -> None:
        if self.inserter.lease_stale():
            self._flush(None, None, keep_leases=False)  # before its lease goes stale (LEASE_KEEP_S)

    def _accept(self, chunk: dict, priorities, tag, unpacked: bool) -> int:
        """Check a chunk, then hold it (a producer's, ``tag`` (producer,
        seq), small, on a table without a rate limiter: coalesce.py) or
        insert it now, after what is held (arrival order); its rows.  A
        rate-limited table's limiter admits each chunk as it comes.
        ``unpacked``: views of a packed chunk, the table's fields already."""
        inserter = self.inserter
        if tag is not None:
            n = inserter.hold(chunk, priorities, tag, unpacked)
            if n is not None:
                return n
        if inserter.held.chunks:
            self._flush(None, None, vouch=False)
        try:
            n = inserter.insert(chunk, priorities)
        except ReservationExpired:
            self._lose()  # this chunk's producer sends it again (the call raises)
            raise
        return inserter.count(n)

    def sync(self, producer: str):
        """Flush now, handing the slot lease back (a producer asks when it
        is done or about to idle); ``[0, acked, lost, incarnation]``."""
        check_call(producer, 0)
        with self.lock:
            self.producers.calling = producer
            self._flush(None, None, keep_leases=False)
            return self.producers.answer(producer, 0)

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
                self.inserter.flush(keep_leases)
        except Exception:
            self.producers.withdraw(producer, seq)
            self._lose()
            raise
        if not vouch:
            return
        self.inserter.flushed(t0, keep_leases)
        self.producers.vouch()

    def _insert_held(self) -> bool:
        """Insert the held chunks, in order; True if the client reconnected
        meanwhile (the daemon restarted): then what went in before is lost,
        and the batch that met the reconnect (retried whole into the new
        daemon) and those after it are kept for this flush."""
        after = self.inserter.insert_held()  # tags of the chunks inserted after a reconnect
        if after is None:
            return False
        for tag in after:
            self.producers.withdraw(*tag)
        try:
            again = self.inserter.notice_restart()  # inserts before it may be lost
        except Exception:
            for tag in after:  # lost with every other unflushed chunk (_flush)
                self.producers.accept(*tag)
            raise
        self._lose()
        for tag in after:
            self.producers.accept(*tag)
        if again:
            self._lose()  # another restart during that flush: they went with the daemon they were in
        return True

    def _lose(self) -> None:
        self.inserter.held.clear()
        self.producers.lose()

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict:
        with self.lock:
            books = self.producers
            return {**self.inserter.stats(), "producers": len(books.seen), "forgotten": books.forgotten,
                    "release_errors": self.release_errors, "producer_ids": books.shown(),  # digests only
                    "node": ray.get_runtime_context().get_node_id()}

    def fields(self) -> dict:
        """The table's fields, name -> (dtype, shape): remote writers build rows to fit."""
        return self.inserter.fields()


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
