"""Parked requests: RESERVEs and SAMPLEs that their table's limits hold back.

A request that its table refuses with ``Blocked`` (and that may still
wait) waits in that table's queue, oldest first per kind, instead of
holding up the engine's loop.  After every pass the engine retries the
queues (``settle``); a request still blocked at its deadline ends with the
error the table gave.  A sleeping engine wakes for the earliest deadline
(``next_deadline``).

This module keeps the books only: which requests wait, in which order,
until when.  Running a request and answering it is the engine's
(``commands.py``), which hands ``settle`` its way of running one.

Owned by the engine's ``Commands``; engine thread only.
"""

from __future__ import annotations

import collections

from ...wire.records import RESERVE
from ..tables.counters import Blocked


class Waiter:
    """A parked RESERVE or SAMPLE."""

    __slots__ = ("cl", "op", "seq", "n", "beta", "deadline", "protect", "wide")

    def __init__(self, cl, op: int, seq: int, n: int, beta: float, deadline: float,
                 protect: bool = False, wide: bool = False):
        self.cl, self.op, self.seq, self.n, self.beta, self.deadline = cl, op, seq, n, beta, deadline
        self.protect = protect
        self.wide = wide  # a SAMPLE whose client gathers on every CPU (records.WIDE)


class Parking:
    def __init__(self):
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

    def queued(self, table_id: int, op: int) -> bool:
        """Is a request of this kind parked on this table?  (A new one then
        parks behind it, to keep the order.)"""
        return bool(self._queue(table_id, op))

    def park(self, table, w: Waiter) -> None:
        self._queue(table.id, w.op).append(w)
        self.count += 1
        self.total += 1
        table.stats["insert_waits" if w.op == RESERVE else "sample_waits"] += 1

    def waiting(self, table_id: int) -> tuple[int, int]:
        """(parked RESERVEs, parked SAMPLEs) of a table."""
        ins, smp = self.queues[table_id]
        return len(ins), len(smp)

    def settle(self, tables: dict, now: float, run) -> list:
        """Retry parked requests with ``run(table, waiter)`` (which raises
        ``Blocked`` while the limits hold it), oldest first per queue, and
        end those whose deadline passed, also behind a head that stays
        blocked.  Queues change only here.  Returns the requests that
        ended: ``(waiter, None)`` ran, ``(waiter, error)`` are to be
        answered with that error (or, for a ``ProtocolError`` or an
        unexpected exception, their client cut off): the caller's to do."""
        ended: list = []
        for tid, queues in self.queues.items():
            table = tables[tid]
            for q in queues:
                while q and _try(table, q[0], now, run, ended):
                    q.popleft()
                    self.count -= 1
                if any(w.deadline <= now for w in q):
                    keep = [w for w in q if not (w.deadline <= now and _try(table, w, now, run, ended))]
                    self.count -= len(q) - len(keep)
                    q.clear()
                    q.extend(keep)
        return ended

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


def _try(table, w: Waiter, now: float, run, ended: list) -> bool:
    """Run a parked request, or end it with its error once its deadline has
    passed.  False while it stays parked."""
    try:
        run(table, w)
    except Blocked as b:
        if w.deadline > now:
            return False
        table.stats["timeouts"] += 1
        ended.append((w, b.error))
        return True
    except Exception as exc:  # the caller answers it, or cuts its client off
        ended.append((w, exc))
        return True
    ended.append((w, None))
    return True


def earliest(*deadlines: float | None) -> float | None:
    """The first of some deadlines (None: no deadline)."""
    return min((d for d in deadlines if d is not None), default=None)
