"""How many slots a writer reserves at a time, and what that leaves samplers.

Both wings use it: a client's writers reserve ``lease_size`` slots at a
time (``client/leases.py``), and a table's definition is checked against
what those leases keep out of the table (``sampling_warning``): a reserved
slot holds no item, so a table whose writers lease ahead never holds all
of its capacity.  Pure functions of a ``TableSpec``; any thread.
"""

from __future__ import annotations

# Below this capacity a writer reserves per call: a lease reserved ahead
# evicts items early (the oldest, which the next inserts evict anyway), and
# in a table of a few hundred items that is a visible share of it.
LEASE_MIN_CAPACITY = 256
LEASE_MIN, LEASE_MAX, QUEUE_LEASE_MAX = 16, 4096, 16


def lease_size(spec, max_batch: int = LEASE_MAX) -> int:
    """Slots a writer reserves at a time (0: per call), and asks for again
    at half time, so inserts need no round trip: capacity/256, at least 16
    (a 1,000-item table: 16, where one round trip per call capped inserts
    at a quarter of cpprb's rate), at most 4,096.  Two leases per writer
    withhold at most ~1% of a large table from sampling, ~3% of a
    1,000-item one.  A rate-limited table (a queue) leases at most 16 and a
    64th of its capacity: its limiter counts a reserved slot as an insert,
    so a lease takes that much of the limiter's room before the items are
    written (it is handed back at ``flush()`` and when the writer closes)."""
    cap = spec.capacity
    if cap < LEASE_MIN_CAPACITY:
        return 0
    size = max(LEASE_MIN, cap // 256)
    if spec.rate_limited:
        size = min(size, QUEUE_LEASE_MAX, cap // 64)
    return max(0, min(LEASE_MAX, size, max_batch))


def writer_reserved(spec) -> tuple[int, int]:
    """(fewest, most) slots one writer that inserts an item at a time
    (``Table.insert``, ``SequenceWriter``, ``NStepWriter``) keeps reserved
    between its calls once the table is full.  From ``client/lease.py``: a
    lease of s slots asks for the next s when fewer than s // 2 are left,
    so after a call s // 2 to s // 2 - 1 + s are reserved and not written.
    A writer of batches larger than s reserves each batch exactly and keeps
    none between calls; a writer whose items stay open across calls (an
    n-step writer's last n) keeps those too, and a lease widened by
    ``Table.widen_lease`` (the Ray ingest's) keeps up to 1.5 times its size."""
    s = lease_size(spec)
    return (s // 2, s // 2 - 1 + s) if s >= 2 else (s, s)


def sampling_warning(spec, sync_headroom: int = 0) -> str | None:
    """Why ``min_size_to_sample`` may never be reached with the writers the
    client gives, or None.  ``sync_headroom``: what a full durable table
    keeps out of use once it has synced (the daemon's ``barrier.py``; 0 for
    any other table): free or retired slots, refilled to the headroom
    whenever half of it is used, so headroom // 2 + 1 to headroom of them.

    Where the line is.  Refused (``schema._check_limits``) is only what no
    writer can ever reach: more than ``capacity``.  Everything up to
    capacity some writer reaches: one that inserts batches larger than its
    lease reserves each batch exactly and holds nothing between calls, a
    table of under 256 items is leased per call, and a durable table filled
    once and then only read stays full.  So the settings past what leases
    and syncs leave are warned, not refused: past ``capacity - most``
    (``writer_reserved``, and the whole headroom) a table written by one
    writer of single items is at times, and past ``capacity - fewest`` (and
    half the headroom) always, short of it, and sampling stalls or waits
    for ever (CleanRL's defaults, a 10,000-item buffer that starts learning
    at 10,000, are the second).  A rate-limited table is not warned for its
    leases: its limiter stops its writers, whose leases run out, and then
    every reserved slot is written and the table fills."""
    mss, cap = spec.min_size_to_sample, spec.capacity
    fewest, most = (0, 0) if spec.rate_limited else writer_reserved(spec)
    kept_least = sync_headroom // 2 + 1 if sync_headroom else 0
    # a durable table's ask ahead refused for a full barrier has evicted up
    # to its lease past the headroom, but then its writer holds fewer than
    # half a lease: both together stay within most + headroom
    limit = cap - most - sync_headroom
    if mss <= limit:
        return None
    # a durable table's writer may be waiting for a sync with its lease run
    # dry (its lease asked ahead is refused then): none reserved at all
    fullest = cap - (0 if sync_headroom else fewest) - kept_least
    never = mss > fullest
    parts = []
    if most:
        parts.append(f"a writer that inserts one item at a time (Table.insert, SequenceWriter, "
                     f"NStepWriter) keeps {fewest} to {most} slots reserved ahead (its lease of "
                     f"{lease_size(spec)}, asked for again when half is used), and a reserved slot "
                     "holds no item")
    if sync_headroom:
        parts.append(f"a durable table keeps {kept_least} to {sync_headroom} slots evicted ahead "
                     "of its next sync once it has synced")
    return (f"table {spec.name!r}: min_size_to_sample {mss} of capacity {cap} is "
            + ("never" if never else "not always") + " reached while the table is written: "
            + "; ".join(parts) + f"; so it holds at most {fullest} items, at times only {limit}, "
            "and sampling " + ("waits for ever" if never else "stalls") + ".  Set "
            f"min_size_to_sample to at most {limit}" + (
                f" (less with more writers), or insert in batches of more than "
                f"{lease_size(spec)} items" if most else "") + " (docs/guide.md, Tables)")
