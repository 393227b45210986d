"""The engine's read of a run of COMMIT records, as one numba kernel over
the ring's records viewed as uint64 words (``channel.Ring.words``);
``records.read_commit_run`` calls it for payload-free runs (single
inserts, which carry no priorities), whose loop it replaces (its twin in
tests/test_commit_runs.py).  Engine thread only, like the ring's consumer
end; a pure function of its arguments.
"""

from __future__ import annotations

import numba
import numpy as np

from ..numbaconf import JIT

# records as uint64 words (``Ring.words``): word 0 holds op (bits 0-15) and
# table (bits 32-63), then seq, a0, a1, a2, f0, pay_off, pay_len
_W_OP, _W_A0, _W_A1, _W_A2, _W_PAY_LEN = 0, 2, 3, 4, 7


@numba.njit(**JIT)
def commit_run(words, tail, i, n, table, rid, offset, top, commit):
    """The run of payload-free COMMIT records that starts at pending record
    ``i`` (of ``n``) and continues reservation ``rid`` of ``table`` from
    ``offset``: (index after it, items in it), or (-k - 1, 0) if record k's
    count is outside 1..``top``; ``commit`` is ``records.COMMIT``.
    ``read_commit_run``'s loop, in one call: at
    ~7 us a record from Python, ten single inserts of a lease cost the
    sample that followed them ~90 us in the daemon.  Each word is read
    once: a client rewriting its record meanwhile changes only what it
    asked for.  ``table``, ``rid`` and ``offset`` come as uint64 and every
    comparison is unsigned (numba compares uint64 with int64 as floats)."""
    slots = words.shape[0]
    table_u, rid_u, offset_u, top_u = table, rid, offset, np.uint64(top)
    op_mask, commit_op, zero, one, shift = np.uint64(0xFFFF), np.uint64(commit), np.uint64(0), np.uint64(1), np.uint64(32)
    total = zero
    j = i
    while j < n:
        at = (tail + j) % slots
        head = words[at, _W_OP]
        a2 = words[at, _W_A2]
        if j > i and ((head & op_mask) != commit_op or (head >> shift) != table_u
                      or words[at, _W_A0] != rid_u
                      or a2 < offset_u or a2 - offset_u != total  # offset + total, never wrapped
                      or words[at, _W_PAY_LEN] != zero):
            break
        k = words[at, _W_A1]
        if k < one or k > top_u:
            return -j - 1, 0
        total += k
        j += 1
    return j, np.int64(total)
