"""Payload-free COMMIT records (single inserts, which carry no priorities)
as numba kernels over the ring's records viewed as uint64 words
(``channel.Ring.words``): both ends of the one record a step-by-step
writer sends per insert.

* ``commit_run``: the engine's read of a run of them
  (``records.read_commit_run``, whose loop it replaces; its twin in
  tests/test_commit_runs.py).  Engine thread only, like the ring's consumer
  end; a pure function of its arguments.
* ``put_commit_one``: a client's write of one, published at once
  (``channel.Ring.commit_one``, for ``pipe.CommandPipe.commit_one``).  The
  client's thread only, like the ring's producer end; ``warm`` loads it
  (from numba's cache, or compiles it) when the pipe is made, so that the
  first insert does not.
* ``answers_only``: whether the replies waiting on a client's response
  ring are all successes, which the calls that wait for them read, or one
  is an error the client must read before it writes on (``add_one``'s
  first test).  The client's thread only, like the ring's consumer end.
"""

from __future__ import annotations

import numba
import numpy as np

from ..numbaconf import JIT
from .atomics import load, store

# records as uint64 words (``Ring.words``): word 0 holds op (bits 0-15),
# status (bits 16-31) and table (bits 32-63), then seq, a0, a1, a2, f0,
# pay_off, pay_len
# (the word indices and masks every kernel over records uses: replytake.py's too)
W_OP, W_SEQ, W_A0, W_A1, W_A2, W_PAY_OFF, W_PAY_LEN = 0, 1, 2, 3, 4, 6, 7
MASK16, STATUS_SHIFT = np.uint64(0xFFFF), np.uint64(16)  # op: word 0 & MASK16; status: >> 16 & MASK16
SLEEPING_TOP = 2**62  # put_commit_one's largest sleeping word


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
    commit_op, zero, one, shift = np.uint64(commit), np.uint64(0), np.uint64(1), np.uint64(32)
    total = zero
    j = i
    while j < n:
        at = (tail + j) % slots
        head = words[at, W_OP]
        a2 = words[at, W_A2]
        if j > i and ((head & MASK16) != commit_op or (head >> shift) != table_u
                      or words[at, W_A0] != rid_u
                      or a2 < offset_u or a2 - offset_u != total  # offset + total, never wrapped
                      or words[at, W_PAY_LEN] != zero):
            break
        k = words[at, W_A1]
        if k < one or k > top_u:
            return -j - 1, 0
        total += k
        j += 1
    return j, np.int64(total)


# client/addone.py's add_one compiles this in: numba's cache stamps a cached
# kernel by the bytes of its own file alone, so addone.py carries a hash of
# this file (``COMPILED_IN``, which tests/test_add_one.py checks): a change
# here changes addone.py too, else a warm machine would run the old record
@numba.njit(**JIT)
def put_commit_one(words, ctl, head, tail_w, head_w, sleeping_w, commit, table, seq, rid, offset):
    """Write a COMMIT (``commit``: ``records.COMMIT``) of one item, no
    payload and no priority, at record ``head`` and publish it: the
    consumer's sleeping word (>= 0, as ``Ring.publish`` returns it, at
    most ``SLEEPING_TOP``), or -1 with nothing written when the ring has no
    room or its tail is corrupt
    (``Ring.room`` <= 0: the caller takes the path that waits).  One call
    for what ``room``, ``put`` and ``publish`` do from Python in three
    (~4 us, a seventh of a CartPole insert).  The record's words are plain
    stores, the head a seq_cst one after them: the consumer, which reads
    the head first, never sees the record half written.  The numbers come
    as Python ints (typed int64: a table id, a sequence number, a
    reservation id and an offset are all far below 2**63), cast here: an
    ``np.uint64`` made in Python costs ~1 us each."""
    slots = words.shape[0]
    # unsigned, as Ring.room compares Python ints: a tail a peer scribbled
    # past the head (near 2**64, say) is no room, never a small "used"
    tail, at_head = load(ctl, tail_w), np.uint64(head)
    if tail > at_head or at_head - tail >= np.uint64(slots):
        return -1
    at = np.int64(head) % slots
    zero = np.uint64(0)
    words[at, W_OP] = np.uint64(commit) | (np.uint64(table) << np.uint64(32))
    words[at, W_SEQ] = np.uint64(seq)
    words[at, W_A0] = np.uint64(rid)
    words[at, W_A1] = np.uint64(1)
    words[at, W_A2] = np.uint64(offset)
    words[at, 5] = zero  # f0: 0.0
    words[at, W_PAY_OFF] = zero
    words[at, W_PAY_LEN] = zero
    store(ctl, head_w, np.uint64(head + 1))
    sleeping = load(ctl, sleeping_w)
    # a peer may leave any 64-bit value there: one that would read as a
    # negative int64 (and so as "no room") reads as SLEEPING_TOP, which
    # means what it means (every value >= ASLEEP_WAITING means the same)
    return np.int64(sleeping) if sleeping < np.uint64(SLEEPING_TOP) else np.int64(SLEEPING_TOP)


# client/addone.py's add_one compiles this in too (``COMPILED_IN``, as above)
@numba.njit(**JIT)
def answers_only(words, ctl, head_w, tail):
    """True when every record waiting on a response ring (``words``, its
    ``Ring.words``; ``ctl[head_w]`` its head, ``tail`` what the client has
    read) carries status 0: replies to a RESERVE, SAMPLE or FLUSH, which
    the call that sent it waits for and reads then.  False when one
    carries an error (a refused COMMIT's, say, which only the prologue's
    ``drain`` reads: it becomes the next call's error) or the head is
    impossible (the Python path raises ProtocolError).  Reads each status
    once, after the head (an atomic load: the daemon writes a record
    before it publishes it)."""
    slots = words.shape[0]
    n = np.int64(load(ctl, head_w)) - tail
    if n < 0 or n > slots:
        return False
    for j in range(n):
        if (words[(tail + j) % slots, W_OP] >> STATUS_SHIFT) & MASK16:
            return False
    return True


def warm() -> None:
    """Load ``put_commit_one`` and ``answers_only`` now, on scratch arrays
    (a client's pipe calls it once: the load or compile, ~0.15-1 s, then
    falls on connecting rather than on the first insert or sample)."""
    words, ctl = np.zeros((1, 8), np.uint64), np.zeros(4, np.uint64)
    put_commit_one(words, ctl, 0, 1, 0, 2, 2, 0, 1, 1, 0)
    answers_only(words, ctl, 0, 1)
