"""The ingest actor: remote producers' chunks into a table, as one local client.

Who calls it: ``start_ingest`` a driver or actor on the replay node; the
actor's methods run one at a time (a Ray actor without concurrency), called
by ``RemoteWriter`` (writer.py) from any node.
"""

from __future__ import annotations

import os
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import DaemonUnavailable, ReplayError, ReservationExpired

# what says inserts since the last flush may not be stored: a daemon restart
# (the client reconnected), or a lease the daemon voided (ReservationExpired)
_LOSSES = (DaemonUnavailable, ReservationExpired)

# A slot lease the ingest has held this long is handed back (a flush that
# keeps nothing) before its next insert: the daemon voids a reservation no
# commit touched for reservation_timeout_s (60 s by default), which a lease
# kept across flushes, or asked ahead, may be after an idle spell or under
# slow steady traffic, and a commit into a void lease is refused
# (ReservationExpired, which the ingest also survives: the chunks go again).
LEASE_KEEP_S = 10.0

# What the ingest owes a producer (sequence numbers flushed or lost since
# its last answer) is dropped once the producer has not called for this
# long: a producer that died never collects it.  One that only went quiet
# and comes back finds its held chunks unaccounted for at its next flush
# and sends them again (stored twice, never lost).
FORGET_S = 600.0


class Ingest:
    """The ingest actor: one local client of the daemon, one table.

    Confirmation is batched: a chunk is inserted when it arrives, but the
    client's flush (a round trip that vouches for every insert before it
    and hands back unused slot leases, four times a 64-row chunk's insert)
    runs once per ``flush_every`` chunks, or when a producer asks (``sync``).
    Each answer to a producer carries the sequence numbers of its chunks
    flushed since its last answer (``acked``) and of those a daemon restart
    may have lost (``lost``: it sends them again), and this incarnation's
    id, so a producer sees that a restart lost what it had not flushed."""

    def __init__(self, socket_path: str, table: str, timeout: float | None, flush_every: int = 16,
                 forget_s: float = FORGET_S):
        import uuid

        import shmreplay
        self.client = shmreplay.connect(socket_path, reconnect=True)
        # chunks come in bursts and a flush follows every few: commits need
        # not wake the daemon each (Client.lazy_commits)
        self.client.lazy_commits = True
        self.table = self.client.table(table)
        self.timeout, self.flush_every = timeout, flush_every
        self.incarnation = uuid.uuid4().hex
        self.chunks = self.rows = self.flushes = 0
        self.insert_s = self.flush_s = 0.0  # time spent inserting (limiter waits included) and flushing
        self.unflushed: dict[str, list[int]] = {}  # producer -> seqs inserted since the last flush
        self.acked: dict[str, list[int]] = {}      # producer -> seqs flushed, not yet told
        self.lost: dict[str, list[int]] = {}       # producer -> seqs a daemon restart may have lost
        self.leased_at = None                       # the first insert since the lease was handed back
        self.forget_s = forget_s
        self.lease_asked = 0  # slots per reservation asked of the table (Table.widen_lease)
        self.seen: dict[str, float] = {}            # producer -> when it was last answered (FORGET_S)
        self.forgotten = 0                          # producers whose dues were dropped
        self.calling = None                         # the producer whose call runs now: never forgotten

    def insert(self, chunk: dict, priorities=None):
        """Insert one chunk (waiting for the table's limits), flush, and
        return how many rows: the plain call, for a driver that inserts now
        and then.  Raises the table's or the daemon's error."""
        self.calling = None
        n = self._insert(chunk, priorities)
        self._flush(None, None)
        return n

    def put(self, chunk: dict, meta: tuple):
        """A ``RemoteWriter``'s chunk: ``meta`` is ``(priorities, producer,
        seq, sync)`` (one argument: Ray serializes each argument apart, and
        a call's arguments cost the producer and this actor more CPU than
        inserting a small chunk).  Inserts the chunk (waiting for the
        table's limits), flushes if ``sync`` or ``flush_every`` chunks wait,
        and returns ``(rows, acked, lost, incarnation)`` for that producer.
        Raises the table's or the daemon's error (the chunk is then not
        counted as inserted)."""
        priorities, producer, seq, sync = meta
        self.calling = producer
        reconnects = self.client.reconnects
        n = self._insert(chunk, priorities)
        self.unflushed.setdefault(producer, []).append(seq)
        # a reconnect during the insert (the daemon restarted): flush now, so
        # the chunks unflushed before it are reported lost at once, not at
        # the next flush with every chunk inserted since
        waiting = sum(map(len, self.unflushed.values()))  # chunks inserted since the last flush
        if sync or waiting >= self.flush_every or self.client.reconnects != reconnects:
            self._flush(producer, seq)
        return self._answer(producer, n)

    def _insert(self, chunk: dict, priorities) -> int:
        if self.leased_at is not None and time.monotonic() - self.leased_at > LEASE_KEEP_S:
            self._flush(None, None, keep_leases=False)  # before its lease goes stale (LEASE_KEEP_S)
        t0 = time.perf_counter()
        try:
            if self.leased_at is None:
                self.leased_at = time.monotonic()
            self.table.insert_batch(chunk, priorities, timeout=self.timeout)
        except ReservationExpired:
            self._lose_unflushed()  # this chunk's producer sends it again (the call raises)
            raise
        self.insert_s += time.perf_counter() - t0
        n = len(next(iter(chunk.values())))
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

    def sync(self, producer: str):
        """Flush now, handing the slot lease back (a producer asks when it
        is done or about to idle); ``(0, acked, lost, incarnation)``."""
        self.calling = producer
        self._flush(None, None, keep_leases=False)
        return self._answer(producer, 0)

    def _answer(self, producer: str, rows: int):
        """What a producer is told: (rows, acked, lost, incarnation)."""
        self.seen[producer] = time.monotonic()
        return rows, self.acked.pop(producer, []), self.lost.pop(producer, []), self.incarnation

    def _forget_silent(self) -> None:
        """Drop what is owed to producers silent for ``forget_s`` (FORGET_S);
        ``forgotten`` counts those that were owed something."""
        now = time.monotonic()
        for p in [p for p, t in self.seen.items() if now - t > self.forget_s]:
            if p == self.calling or p in self.unflushed:  # calling now, or its chunk is being flushed
                continue
            del self.seen[p]
            owed = self.acked.pop(p, None), self.lost.pop(p, None)
            self.forgotten += owed != (None, None)

    def _flush(self, producer, seq, keep_leases: bool = True) -> None:
        t0 = time.perf_counter()
        try:
            # keep the slot lease: the next chunk's insert then needs no
            # reservation round trip (LEASE_KEEP_S bounds how long)
            self.client.flush(keep_leases=keep_leases)
        except _LOSSES:
            # inserts since the last flush may not be stored.  The current
            # call's chunk is re-sent by its producer (the call raises); the
            # others are reported lost in their producers' answers.
            if producer is not None:
                self.unflushed[producer].remove(seq)
            self._lose_unflushed()
            raise
        if not keep_leases:
            self.leased_at = None
        self.flushes += 1
        self.flush_s += time.perf_counter() - t0
        self._forget_silent()  # before the flushed seqs move: their producers are calling
        for p, seqs in self.unflushed.items():
            self.acked.setdefault(p, []).extend(seqs)
        self.unflushed.clear()

    def _lose_unflushed(self) -> None:
        for p, seqs in self.unflushed.items():
            self.lost.setdefault(p, []).extend(seqs)
        self.unflushed.clear()

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict:
        return {"chunks": self.chunks, "rows": self.rows, "flushes": self.flushes,
                "insert_s": self.insert_s, "flush_s": self.flush_s,
                "producers": len(self.seen), "forgotten": self.forgotten,
                "node": ray.get_runtime_context().get_node_id()}

    def fields(self) -> dict:
        """The table's fields, name -> (dtype, shape): remote writers build rows to fit."""
        return {f.name: (f.dtype.str, tuple(f.shape)) for f in self.table.spec.fields}


def start_ingest(socket_path: str, table: str, node_id: str | None = None, name: str | None = None,
                 timeout: float | None = None, max_restarts: int = -1, flush_every: int = 16,
                 forget_s: float = FORGET_S):
    """An ingest actor for ``table`` of the daemon at ``socket_path``,
    pinned (``soft=False``) to ``node_id`` (default: the caller's node,
    which must be the daemon's).  ``name``: a Ray actor name, so producers
    may find it with ``ray.get_actor``.  ``timeout``: the longest a chunk
    may wait for the table's limits (None: as long as it takes; the
    producers wait with it).  ``flush_every``: chunks inserted per flush
    (a producer may ask for one sooner).  ``forget_s``: how long what is
    owed to a producer that stopped calling is kept (FORGET_S)."""
    if not isinstance(flush_every, int) or flush_every < 1:
        raise ReplayError(f"flush_every must be an int >= 1, got {flush_every!r}")
    if isinstance(forget_s, bool) or not isinstance(forget_s, (int, float)) or not forget_s >= 0:
        raise ReplayError(f"forget_s must be a number of seconds >= 0, got {forget_s!r}")
    node = node_id or ray.get_runtime_context().get_node_id()
    opts = dict(num_cpus=0, max_restarts=max_restarts,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
    if name is not None:
        opts["name"] = name
    return ray.remote(Ingest).options(**opts).remote(socket_path, table, timeout, flush_every, forget_s)
