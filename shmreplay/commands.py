"""Data-plane commands: what a record in a channel ring means.

Every request names its table by id and carries a client-chosen ``seq``;
a response echoes ``op`` and ``seq``.  ``status`` is 0 on success, else an
``errors`` code with the UTF-8 message as payload.  Commands marked
"no reply" are answered only when they fail, so a client can stream them.
docs/protocol.md gives the same table with the message sequences.

=========  ====================================  ==========================================
op         request                               response
=========  ====================================  ==========================================
RESERVE    a0 = n                                a0 = reservation id, a1 = 1 if the slots
                                                 are one ascending run, a2 = n;
                                                 payload uint32[n] slot indices
COMMIT     a0 = reservation id, a1 = n,          no reply
           a2 = offset: commits slots
           [a2, a2 + n) of the reservation, which
           must follow the last part committed;
           payload float64[n] priorities, or
           empty for "max priority seen so far"
ABORT      a0 = reservation id                   no reply; frees the slots not committed
SAMPLE     a0 = n, f0 = beta                     a0 = n; payload uint64[n] keys,
                                                 float64[n] probabilities, float64[n] weights
UPDATE     a0 = n; payload uint64[n] keys,       no reply (stale keys are counted)
           float64[n] priorities
FLUSH      -                                     empty; sent once every earlier request
                                                 of this client has been applied
=========  ====================================  ==========================================
"""

from __future__ import annotations

RESERVE = 1
COMMIT = 2
ABORT = 3
SAMPLE = 4
UPDATE = 5
FLUSH = 6

NAMES = {RESERVE: "RESERVE", COMMIT: "COMMIT", ABORT: "ABORT", SAMPLE: "SAMPLE",
         UPDATE: "UPDATE", FLUSH: "FLUSH"}

SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1

# largest n a single RESERVE, SAMPLE or UPDATE may carry; the channel's
# payload areas are sized for it (SAMPLE responses: 24 bytes per item)
MAX_BATCH = 65536
