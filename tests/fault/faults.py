"""Helpers of the fault tests: rows that show tearing, and worker processes.

A row of item ``i`` is ``id = i`` and ``obs`` filled with ``i % 251``; a
row that mixes two writes, or was never fully written, fails ``torn()``
(both from ``idrows.py``, re-exported here with ``table_state`` from
``readback.py``).  Workers run in forked processes and report through a queue.

Nothing here waits by the clock: ``wait_for`` polls a condition, and its
timeout is a hang guard (generous, for a loaded CI box), never a speed
requirement.
"""

from __future__ import annotations

import os
import time

import numpy as np

import shmreplay
from idrows import FIELDS, rows, torn  # noqa: F401  (the fault tests take them from here)
from readback import table_state  # noqa: F401
from waiting import HANG_S, reap, wait_for  # noqa: F401
from shmreplay.wire.layout import COMMITTED, HELD, RESERVED, TableMap
from shmreplay.wire.records import key_slots


def writable_map(segment: str) -> TableMap:
    """A table's segments mapped read-write, as only the daemon's own user
    (or root) can: the meta segment is read-only to every client."""
    from shmreplay.wire.rowfile import rows_name
    from shmreplay.wire.segment import Segment
    return TableMap._checked(Segment.attach(segment), Segment.attach(rows_name(segment)))


def committed_ids(segment: str) -> np.ndarray:
    """The ids of every committed item, read straight from the table segment."""
    tm = TableMap.attach(segment)
    try:
        slots = np.flatnonzero(tm.state == COMMITTED)
        data = {k: tm.fields[k][slots].copy() for k in tm.fields}
        assert torn(data) == 0, "a committed row is torn"
        return np.sort(data["id"])
    finally:
        tm.release()


def actor(sock, table, first_id, stop, out, confirm_every=64, pause=0.002, budget=None):
    """Insert ids first_id, first_id + 1, ... with priorities; after each
    flush that returned, the ids since the previous one count as confirmed.
    Reconnects through daemon restarts.  ``budget``: insert at most that
    many items per connection (a restart gives a new budget), then only
    flush until stopped, so a test can bound what it inserts by count, not
    by how fast the box runs; the actor still talks to the daemon, so it
    notices a restart."""
    c = shmreplay.connect(sock, timeout=30, reconnect=True, reconnect_timeout=120)
    t = c.table(table)
    i, pending, confirmed, lost, errors = first_id, [], [], 0, []
    epoch, left = c.reconnects, budget
    # a flush may vouch for nothing a restart lost: once a call reconnected
    # while inserts were unflushed, the next flush must say "may be lost"
    owed, vouched_wrongly = False, 0
    while not stop.is_set():
        try:
            if c.reconnects != epoch:
                epoch, left = c.reconnects, budget
            if left is None or left > 0:
                ids = np.arange(i, i + 8)
                i += 8
                had, seen = bool(pending), c.reconnects
                t.insert_batch(rows(ids), priorities=1.0 + (ids % 7))
                owed = owed or (had and c.reconnects != seen)
                pending.extend(ids.tolist())
                if left is not None:
                    left -= 8
            spent = left is not None and left <= 0  # then flush each round: still talking
            if len(pending) >= confirm_every or spent:
                had, seen = bool(pending), c.reconnects
                c.flush()
                if owed or (had and c.reconnects != seen):
                    vouched_wrongly += 1
                owed = False
                confirmed.extend(pending)
                pending = []
        except shmreplay.DaemonUnavailable as exc:
            if "may be lost" in str(exc):
                owed = False
            lost += len(pending)  # not vouched for: may or may not be in the table
            pending = []
            errors.append(str(exc)[:80])
        time.sleep(pause)
    try:
        c.flush()
        confirmed.extend(pending)
    except shmreplay.DaemonUnavailable:
        pass
    out.put(("actor", os.getpid(), confirmed, lost, c.reconnects, errors[:3], vouched_wrongly))
    c.close()


def learner(sock, table, stop, out, batch=32):
    c = shmreplay.connect(sock, timeout=30, reconnect=True, reconnect_timeout=120)
    t = c.table(table)
    n = bad = 0
    while not stop.is_set():
        try:
            b = t.sample(batch, timeout=0.2)
        except shmreplay.RateLimited:
            continue
        n += len(b)
        bad += torn(b.data)
    out.put(("learner", os.getpid(), n, bad, c.reconnects))
    c.close()


POISON = 0xEE
STEPS = ("after_reserve", "mid_copy", "after_commit", "rate_limited_wait", "learner_mid_gather")


def victim(sock, step, first_id, ready):
    """A client that gets as far as ``step``, says so, and waits to be SIGKILLed."""
    from rawclient import reserve
    c = shmreplay.connect(sock, timeout=30)
    if step in ("after_reserve", "mid_copy"):
        t = c.table("t")
        _, _, slots = reserve(t, 8)
        if step == "mid_copy":  # half the rows written, half of those half-way
            t._views["id"][slots[:4]] = -1
            t._views["obs"][slots[:4], :32] = POISON
        ready.set()
    elif step == "after_commit":
        c.table("t").insert_batch(rows(np.arange(first_id, first_id + 8)))
        ready.set()
    elif step == "rate_limited_wait":
        q = c.table("q")
        ready.set()
        q.insert(**{k: v[0] for k, v in rows([first_id]).items()})  # parks: the queue is full
    elif step == "learner_mid_gather":
        t = c.table("once")
        keys, _, _ = t.sample_indices(4)
        half = key_slots(keys[:2])
        np.take(t._views["obs"], half, axis=0)
        ready.set()
    time.sleep(600)


# ---- segment reads for test_writer_restart.py (the only package internals it uses) ----

def segment_rows(segment: str) -> tuple[dict, int]:
    """Every committed row, read straight from the table segment, as
    {field: array} plus ``_slot`` and ``_seqno`` (commit number); and how many
    items have left the table so far (evicted or removed: the live word)."""
    tm = TableMap.attach(segment)
    try:
        slots = np.flatnonzero(tm.state == COMMITTED)
        data = {k: v[slots].copy() for k, v in tm.fields.items()}
        data["_slot"], data["_seqno"] = slots, tm.seqno[slots].copy()
        return data, tm.words.deletes
    finally:
        tm.release()


def void_slots(segment: str) -> tuple[np.ndarray, np.ndarray]:
    """The slots a writer had reserved (or a learner held) and their stamps:
    read after a SIGKILL, these are what the next daemon voids and gives
    out again once nobody can still write them (server/tables/slots/orphans.py)."""
    tm = TableMap.attach(segment)
    try:
        slots = np.flatnonzero((tm.state == RESERVED) | (tm.state == HELD))
        return slots, tm.gens[slots].copy()
    finally:
        tm.release()


def lease_pids(segment: str, slots: np.ndarray) -> np.ndarray:
    """The pid each of ``slots`` is (or was last) leased to, from the meta segment."""
    tm = TableMap.attach(segment)
    try:
        return tm.lease_pid[slots].copy()
    finally:
        tm.release()


def reissued(segment: str, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
    """Per slot of ``void_slots``: it holds a committed item again, under a
    newer stamp (bumped once when voided, again when reserved anew)."""
    tm = TableMap.attach(segment)
    try:
        moved = (tm.gens[slots] - gens).astype(np.uint32) >= 2  # stamps wrap at 2**32
        return (tm.state[slots] == COMMITTED) & moved
    finally:
        tm.release()
