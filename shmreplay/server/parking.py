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

from ..wire.records import RESERVE


class Waiter:
    """A parked RESERVE or SAMPLE."""

    __slots__ = ("cl", "op", "seq", "n", "beta", "deadline")

    def __init__(self, cl, op: int, seq: int, n: int, beta: float, deadline: float):
        self.cl, self.op, self.seq, self.n, self.beta, self.deadline = cl, op, seq, n, beta, deadline


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

    def busy(self, table_id: int, op: int) -> bool:
        """Are requests of this kind parked on the table (a new one queues behind)?"""
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

    def settle(self, tables: dict, try_one, now: float) -> None:
        """Retry parked requests, oldest first per queue, and answer those
        whose deadline passed, also behind a head that stays blocked.
        ``try_one(table, waiter, now)`` runs or answers one and returns
        False while it stays parked.  Queues change only here."""
        for tid, queues in self.queues.items():
            table = tables[tid]
            for q in queues:
                while q and try_one(table, q[0], now):
                    q.popleft()
                    self.count -= 1
                if any(w.deadline <= now for w in q):
                    keep = [w for w in q if not (w.deadline <= now and try_one(table, w, now))]
                    self.count -= len(q) - len(keep)
                    q.clear()
                    q.extend(keep)

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
