"""Data-plane commands: what a record in a channel ring means.

Every request names its table by id and carries a client-chosen ``seq``;
a response echoes ``op`` and ``seq``.  ``status`` is 0 on success, else an
``errors`` code with the UTF-8 message as payload.  Commands marked
"no reply" are answered only when they fail, so a client can stream them.
docs/protocol.md gives the same table with the message sequences.

=========  ====================================  ==========================================
op         request                               response
=========  ====================================  ==========================================
RESERVE    a0 = n, a1 = timeout (us)             a0 = reservation id, a1 = 1 if the slots
                                                 are one ascending run, a2 = k, the slots
                                                 granted (1 <= k <= n: what the rate
                                                 limiter and the free slots allow);
                                                 payload uint32[k] slot indices
COMMIT     a0 = reservation id, a1 = n,          no reply
           a2 = offset: commits slots
           [a2, a2 + n) of the reservation, which
           must follow the last part committed;
           payload float64[n] priorities, or
           empty for "max priority seen so far"
ABORT      a0 = reservation id                   no reply; frees the slots not committed
SAMPLE     a0 = n, a1 = timeout (us), f0 = beta  a0 = n, a1 = hold id (0: none); payload
                                                 uint64[n] keys, float64[n] probabilities,
                                                 float64[n] weights
RELEASE    a0 = hold id                          no reply; the rows of items a SAMPLE drew
                                                 for the last time (max_times_sampled) are
                                                 read: their slots may be reused
UPDATE     a0 = n; payload uint64[n] keys,       no reply (stale keys are counted)
           float64[n] priorities
FLUSH      -                                     empty; sent once every earlier request
                                                 of this client has been applied (parked
                                                 RESERVE/SAMPLE excepted: they answer
                                                 for themselves)
=========  ====================================  ==========================================

RESERVE and SAMPLE wait in the daemon while the table's limits hold them
(rate limiter, min_size_to_sample, reuse limits, no free slot), for up to
their timeout: 0 means "fail at once", FOREVER means no limit.  A waiting
request is parked: the client's later commands are still served, and the
reply comes when it runs or times out (status RateLimited/EmptyTable, or
CapacityError when every slot stays reserved or held).
"""

from __future__ import annotations

RESERVE = 1
COMMIT = 2
ABORT = 3
SAMPLE = 4
UPDATE = 5
FLUSH = 6
RELEASE = 7

NAMES = {RESERVE: "RESERVE", COMMIT: "COMMIT", ABORT: "ABORT", SAMPLE: "SAMPLE",
         UPDATE: "UPDATE", FLUSH: "FLUSH", RELEASE: "RELEASE"}

FOREVER = 2**64 - 1


def timeout_us(seconds: float | None) -> int:
    """A request's timeout field: seconds (None or inf: no limit) in microseconds."""
    if seconds is None or seconds == float("inf"):
        return FOREVER
    if not seconds >= 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {seconds}")
    return min(FOREVER - 1, int(seconds * 1e6))

SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1

# largest n a single RESERVE, SAMPLE or UPDATE may carry; the channel's
# payload areas are sized for it (SAMPLE responses: 24 bytes per item)
MAX_BATCH = 65536
