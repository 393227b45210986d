"""Parked requests: a RESERVE or SAMPLE that its table's limits hold back.

A request that a table refuses with ``Blocked`` waits in that table's queue,
oldest first per kind, instead of holding up the engine's loop.  After
every pass that did work the engine retries the queues (``settle``), and a
request still blocked at its deadline is answered with the error the table
gave.  Later requests of the same kind on that table queue behind a parked
one, so a large batch is not starved by small ones.  A sleeping engine
wakes for the earliest deadline.

Owned by the engine; engine thread only.
"""

from __future__ import annotations

import collections
import logging
import time

from ...errors import ProtocolError, ReplayError
from ...wire import records as R
from ...wire.records import RESERVE
from ..tables.counters import Blocked

log = logging.getLogger("shmreplayd.engine")


class Waiter:
    """A parked RESERVE or SAMPLE."""

    __slots__ = ("cl", "op", "seq", "n", "beta", "deadline")

    def __init__(self, cl, op: int, seq: int, n: int, beta: float, deadline: float):
        self.cl, self.op, self.seq, self.n, self.beta, self.deadline = cl, op, seq, n, beta, deadline


class Parking:
    def __init__(self, prefetch=None):
        self.prefetch = prefetch  # prefetch.Prefetcher: told which rows each request will touch
        # table id -> (parked RESERVEs, parked SAMPLEs), oldest first
        self.queues: dict[int, tuple[collections.deque, collections.deque]] = {}
        self.count = 0    # requests parked now
        self.total = 0    # requests ever parked

    def add_table(self, table_id: int) -> None:
        self.queues[table_id] = (collections.deque(), collections.deque())

    def drop_table(self, table_id: int) -> list[Waiter]:
        """Take every request parked on a table that goes away."""
        gone = [w for q in self.queues.pop(table_id, ()) for w in q]
        self.count -= len(gone)
        return gone

    def _queue(self, table_id: int, op: int) -> collections.deque:
        return self.queues[table_id][0 if op == RESERVE else 1]

    def admit(self, table, w: Waiter) -> None:
        """A new RESERVE or SAMPLE: run it now, or park it (behind a parked
        one of its kind, to keep the order; or while the limits hold it).
        Raises the table's error if it may not wait."""
        if self._queue(table.id, w.op):
            self.park(table, w)
            return
        try:
            run(table, w, self.prefetch)
        except Blocked as b:
            if w.deadline <= time.monotonic():
                raise b.error from None
            self.park(table, w)

    def park(self, table, w: Waiter) -> None:
        self._queue(table.id, w.op).append(w)
        self.count += 1
        self.total += 1
        table.stats["insert_waits" if w.op == RESERVE else "sample_waits"] += 1

    def waiting(self, table_id: int) -> tuple[int, int]:
        """(parked RESERVEs, parked SAMPLEs) of a table."""
        ins, smp = self.queues[table_id]
        return len(ins), len(smp)

    def settle(self, tables: dict, now: float) -> list:
        """Retry parked requests, oldest first per queue, and answer those
        whose deadline passed, also behind a head that stays blocked.
        Queues change only here.  Returns the clients to cut off, as
        (client, error), once the caller is done walking."""
        doomed: list = []
        for tid, queues in self.queues.items():
            table = tables[tid]
            for q in queues:
                while q and self._try(table, q[0], now, doomed):
                    q.popleft()
                    self.count -= 1
                if any(w.deadline <= now for w in q):
                    keep = [w for w in q if not (w.deadline <= now and self._try(table, w, now, doomed))]
                    self.count -= len(q) - len(keep)
                    q.clear()
                    q.extend(keep)
        return doomed

    def _try(self, table, w: Waiter, now: float, doomed: list) -> bool:
        """Run a parked request, or answer it with its error once its
        deadline has passed.  False while it stays parked."""
        try:
            run(table, w, self.prefetch)
        except Blocked as b:
            if w.deadline > now:
                return False
            table.stats["timeouts"] += 1
            answer(w, b.error, doomed)
            return True
        except ProtocolError as exc:  # its outbox is full: it stopped reading
            doomed.append((w.cl, exc))
            return True
        except ReplayError as exc:
            answer(w, exc, doomed)
            return True
        except Exception as exc:  # a bug this request reached: it costs its client, not the engine
            log.exception("client %d (pid %d): parked request failed", w.cl.id, w.cl.pid)
            doomed.append((w.cl, ProtocolError(f"daemon could not apply a command: {exc!r}")))
            return True
        answer(w, None, doomed)
        return True

    def unpark_client(self, cl) -> int:
        """Forget every request of a client that left; returns how many."""
        n = 0
        for queues in self.queues.values():
            for q in queues:
                keep = [w for w in q if w.cl is not cl]
                n += len(q) - len(keep)
                if len(keep) != len(q):
                    q.clear()
                    q.extend(keep)
        self.count -= n
        return n

    def next_deadline(self) -> float | None:
        if not self.count:
            return None
        return min((w.deadline for queues in self.queues.values() for q in queues for w in q),
                   default=None)


def earliest(*deadlines: float | None) -> float | None:
    """The first of some deadlines (None: no deadline)."""
    return min((d for d in deadlines if d is not None), default=None)


def run(table, w: Waiter, prefetch=None) -> None:
    """Run a RESERVE or SAMPLE and queue its reply; raises Blocked.  Then
    ``prefetch`` learns which rows the client will touch next: a writer the
    reserved slots', a learner the drawn ones' (file-backed tables)."""
    if w.op == RESERVE:
        rid, slots, contiguous = table.reserve(w.cl.id, w.n, w.cl.pid, w.cl.start)
        w.cl.respond(R.reserve_reply(w.seq, rid, slots, contiguous))
        keys = None
    else:
        keys, probs, weights, hid = table.sample(w.cl.id, w.n, w.beta)
        w.cl.respond(R.sample_reply(w.seq, keys, probs, weights, hid))
        slots = None
    if prefetch is not None:
        prefetch.read(table.id, slots, keys)


def answer(w: Waiter, exc: ReplayError | None, doomed: list) -> None:
    """Queue the error reply of a parked request (None: its reply is queued
    already) and publish.  A client that left its replies unread goes on
    ``doomed``, to be cut off once no queue is being walked."""
    try:
        if exc is not None:
            w.cl.respond(R.error_reply(w.op, w.seq, exc))
        w.cl.flush()
    except ProtocolError as err:
        doomed.append((w.cl, err))
