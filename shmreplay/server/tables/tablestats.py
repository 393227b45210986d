"""A table's numbers, as ``stats``/``shmreplay status`` and ``describe`` report them,
and the warnings its settings get (``leasing.sampling_warning``).

Engine thread only, like the table they read (``warn``: also while the
table is built, before the engine has it).
"""

from __future__ import annotations

import logging

from ... import leasing, ratelimiter

log = logging.getLogger("shmreplayd.table")


def new_stats() -> dict:
    """The event counters a ``Table`` keeps (reported as they are)."""
    return {"inserts": 0, "reservations": 0, "samples": 0, "sample_calls": 0, "evictions": 0,
            "removed_after_max_samples": 0, "stale_priority_updates": 0,
            "priority_updates": 0, "reclaimed_reservations": 0, "tree_rebuilds": 0,
            "insert_waits": 0, "sample_waits": 0, "timeouts": 0, "recovered_items": 0,
            "recovered_orphans": 0, "expired_held_slots": 0, "voided_reserved_slots": 0,
            "protected_samples": 0, "parked_pinned_slots": 0}


def describe(t) -> dict:
    """A table's description, the reply to a create or open; ``warnings``
    (only when there are some): settings that may never work, which the
    client that creates the table raises as Python warnings."""
    out = {"id": t.id, "segment": t.segment_name, "spec": t.spec.to_wire(),
           "segment_size": t.map.layout.size + t.map.layout.rows_size, "items": t.counters.size}
    said = warnings(t)
    if said:
        out["warnings"] = said
    return out


def warnings(t) -> list[str]:
    """Why the table's settings may never work with the writers the client
    gives (``leasing.sampling_warning``), with a durable table's sync
    headroom (``SlotLedger.kept_for_sync``)."""
    said = leasing.sampling_warning(t.spec, t.ledger.kept_for_sync())
    return [] if said is None else [said]


def warn(t, durable: bool = False) -> None:
    """Log what ``warnings`` says, when the table is built (``durable``:
    again once it is made durable, if that adds to it)."""
    said = warnings(t)
    if said and (not durable or said[0] != leasing.sampling_warning(t.spec)):
        log.warning("%s", said[0])


def snapshot_stats(t, pids: dict | None = None) -> dict:
    """The numbers of table ``t``; ``pids`` (client id -> pid) names who holds slots."""
    led = t.ledger
    orphaned, orphan_holders = led.orphaned()
    out = {**t.stats, "size": t.counters.size, "capacity": t.spec.capacity,
           "reserved": led.pending + led.voided, "voided": led.voided, "held": t.holds.held,
           "holders": t.holds.holders(pids or {}),
           "orphaned": orphaned, "orphan_holders": orphan_holders,
           "limiter": {**t.counters.snapshot(led.pending), **limiter_state(t, led.pending)},
           "max_priority": t.selection.max_priority, "sampler": t.spec.sampler,
           # what a shard reports to a sharded table's learner (ray/shardmath.py)
           "mass": t.selection.mass, "least": t.selection.least,
           "remover": t.spec.remover, "rows": t.map.rows.name, "rows_bytes": t.map.layout.rows_size,
           "file_backed": t.spec.file_backed, "durable": t.durable is not None}
    if t.durable is not None:
        out.update(t.durable.report(), **led.barrier_report())
    if t.frames is not None:  # what a transition costs: the table's bytes, full, over its items
        out["frames"] = t.frames.report(t.counters.size)
        out["bytes_per_item"] = round((t.map.layout.size + t.map.layout.rows_size) / t.spec.capacity, 1)
    return out


def limiter_state(t, pending: int) -> dict:
    """What the table's limits hold back now, in words (None: nothing):
    an insert of one item, a sample of one."""
    cnt, spec = t.counters, t.spec
    blocked = None if cnt.insert_room(pending, 1) else ratelimiter.insert_blocker(
        spec, cnt.inserts, pending, cnt.samples)
    refusal = cnt.sample_refusal(1, t.selection.mass)
    return {"inserts_blocked": blocked, "samples_blocked": None if refusal is None else str(refusal)}
