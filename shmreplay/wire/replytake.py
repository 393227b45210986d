"""A SAMPLE reply taken off a client's response ring by one kernel.

``take_sample`` does, for the reply a learner is about to wait for when
it is already the next record on the ring, what ``CommandPipe.wait``
then ``records.read_sample_reply`` and ``Ring.consume`` do from Python:
a dozen reads of structured-record fields, three copies and two stores,
~60 us a call in a CleanRL loop whose env step and torch update leave the
caches cold (docs/performance.md, "A reply taken by one kernel").  Its
twin is that Python path (tests/test_reply_take.py, byte for byte).

It takes only the plain case: the record at the ring's tail is a SAMPLE
reply with status 0, the sequence number and item count asked for, and
a payload of exactly those items inside the payload area, 8-byte aligned
(the daemon aligns every payload to 64 bytes).  Anything else (the ring
empty, another reply first, an error, a payload that does not fit) is
left where it is, untouched, for the Python path, which stashes, waits,
raises or reports a protocol error.  So nothing it reads is trusted
further than the Python path trusts it.

The client's thread only (the ring's consumer end), like ``wait``.
"""

from __future__ import annotations

import numba
import numpy as np

from ..numbaconf import JIT
from .atomics import load, store
from .commitrun import MASK16, STATUS_SHIFT, W_A0, W_A1, W_OP, W_PAY_LEN, W_PAY_OFF, W_SEQ

NOT_TAKEN = -1
_HID_TOP = np.uint64(2**62)  # a hold id the daemon gives is far below; above: the Python path


@numba.njit(**JIT)
def take_sample(words, ctl, head_w, tail_w, pay_tail_w, tail, payload64, op, seq, n, keys, probs,
                weights):
    """If the record at ``tail`` of the response ring (``words``: its
    records as uint64[slots, 8], ``ctl`` its control words, ``payload64``
    its payload area as uint64) is the reply ``seq`` (``op``:
    ``records.SAMPLE``) with status 0 and ``n`` items, copy its keys,
    probabilities and weights into the first ``n`` of ``keys``, ``probs``
    and ``weights``, hand the record and its payload back (``pay_tail``,
    then ``tail``, as ``Ring.consume`` stores them) and return its hold id
    (>= 0); else ``NOT_TAKEN`` with nothing written."""
    slots = words.shape[0]
    pending = np.int64(load(ctl, head_w)) - tail
    if pending <= 0 or pending > slots:
        return NOT_TAKEN
    at = tail % slots
    w0 = words[at, W_OP]
    if ((w0 & MASK16) != np.uint64(op) or (w0 >> STATUS_SHIFT) & MASK16 != np.uint64(0)
            or words[at, W_SEQ] != np.uint64(seq) or words[at, W_A0] != np.uint64(n)
            or words[at, W_A1] >= _HID_TOP):
        return NOT_TAKEN
    off, length = words[at, W_PAY_OFF], words[at, W_PAY_LEN]
    size = np.uint64(payload64.shape[0] * 8)
    if length != np.uint64(24 * n) or length > size:
        return NOT_TAKEN
    p = off % size
    if p + length > size or p % np.uint64(8) != np.uint64(0):
        return NOT_TAKEN
    i = np.int64(p // np.uint64(8))
    keys[:n] = payload64[i:i + n]
    probs[:n] = payload64[i + n:i + 2 * n].view(np.float64)
    weights[:n] = payload64[i + 2 * n:i + 3 * n].view(np.float64)
    hid = np.int64(words[at, W_A1])
    store(ctl, pay_tail_w, off + length)
    store(ctl, tail_w, np.uint64(tail + 1))
    return hid


def warm() -> None:
    """Load ``take_sample`` now, on scratch arrays (the client's pipe calls
    it once, as ``commitrun.warm``: a learner's first sample does not pay
    the load or compile)."""
    z = np.zeros(1, np.float64)
    take_sample(np.zeros((1, 8), np.uint64), np.zeros(4, np.uint64), 0, 1, 2, 0,
                np.zeros(3, np.uint64), 4, 1, 1, np.zeros(1, np.uint64), z, z.copy())
