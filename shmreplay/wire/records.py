"""The data-plane codec: what each record in a channel ring means, and the slot key.

Both sides call only these functions: the client encodes requests
(``put_*``) and decodes replies (``read_*_reply``); the engine decodes
requests (``read_*``) and builds replies (``*_reply``).  No other module
knows which record field or payload byte carries what.

Every request names its table by id and carries a client-chosen ``seq``;
a reply echoes ``op`` and ``seq``.  ``status`` is 0 on success, else an
``errors`` code with the UTF-8 message as payload.  Commands marked "no
reply" are answered only when they fail, so a client can stream them.
docs/protocol.md gives the same table as message sequences.

=========  ====================================  ==========================================
op         request                               reply
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

RESERVE and SAMPLE wait in the daemon while the table's limits hold them,
for up to their timeout: 0 means "fail at once", FOREVER means no limit.
One that times out is answered with a ``RateLimited`` (``EmptyTable``, or
``SlotsBusy`` when every slot stayed reserved or held): the client's
slices retry exactly those.

Keys.  A sampled item is named by ``gen << 32 | slot``: the slot and the
generation stamp the slot had when the item was committed.  A reader that
finds another stamp in the slot knows the row was (or is being) overwritten.

Trust.  The engine decodes what a client wrote into shared memory: every
``read_*`` bounds counts and payload sizes and raises ``ProtocolError`` (the
client is cut off) or ``CapacityError`` (the request is refused) before any
value is used.

Pure functions over a ring (``channel.Ring``): called by whichever thread
owns that end of the ring (the client's thread, the engine thread).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import CapacityError, ProtocolError, ReplayError, error_from_code
from .commitrun import commit_run

# Bump when any record's meaning or payload layout changes; the channel
# header carries it and both sides refuse a channel of another version.
VERSION = 1

RECORD = np.dtype([
    ("op", "<u2"), ("status", "<u2"), ("table", "<u4"), ("seq", "<u8"),
    ("a0", "<u8"), ("a1", "<u8"), ("a2", "<u8"), ("f0", "<f8"),
    ("pay_off", "<u8"), ("pay_len", "<u8"),
])
assert RECORD.itemsize == 64

RESERVE, COMMIT, ABORT, SAMPLE, UPDATE, FLUSH, RELEASE = 1, 2, 3, 4, 5, 6, 7

FOREVER = 2**64 - 1
# largest n a single RESERVE, SAMPLE or UPDATE may carry
MAX_BATCH = 65536

_KEY, _F64, _SLOT = 8, 8, 4   # payload bytes per key, float64, slot index
# payload areas of a channel: two of the largest request (UPDATE) and reply (SAMPLE)
REQUEST_PAYLOAD_BYTES = 2 * (_KEY + _F64) * MAX_BATCH
REPLY_PAYLOAD_BYTES = 2 * (_KEY + 2 * _F64) * MAX_BATCH


def timeout_us(seconds: float | None) -> int:
    """A request's timeout field: seconds (None or inf: no limit) in microseconds."""
    if seconds is None or seconds == float("inf"):
        return FOREVER
    if not seconds >= 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {seconds}")
    return min(FOREVER - 1, int(seconds * 1e6))


# ---- keys ----
SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1
_BITS = np.uint64(SLOT_BITS)
_MASK = np.uint64(SLOT_MASK)


def make_keys(gens: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Keys of ``slots`` whose stamps are ``gens``."""
    return (gens.astype(np.uint64) << _BITS) | slots.astype(np.uint64)


def key_slots(keys: np.ndarray) -> np.ndarray:
    return (keys & _MASK).astype(np.intp)


def stale(keys: np.ndarray, stamps: np.ndarray) -> np.ndarray:
    """Mask of keys whose slot's stamp (``stamps``: a table's gens array) moved on."""
    return stamps[key_slots(keys)].astype(np.uint64) != (keys >> _BITS)


def owner_key(daemon_pid: int, client_id: int) -> int:
    """The name of one lease: the granting daemon's pid << 32 | the client's
    id there.  The daemon records it with every slot it leases (a dead
    daemon's successor reads it, ``server/tables/slots/orphans.py``); a client
    that reconnects names its old one in ``hello``'s ``resume``."""
    return (int(daemon_pid) << SLOT_BITS) | int(client_id)


# ---- arguments ----
def check_count(value, what: str, top: int = MAX_BATCH, error=CapacityError) -> int:
    """``value`` as an item count of one command, 1..``top``; else ``error``
    naming it (``what``: its description, with ``{n}`` for the value)."""
    n = int(value)
    if not 1 <= n <= top:
        raise error(f"{what.format(n=n)} outside the allowed 1..{top}")
    return n


def check_draw(n, beta, what: str = "SAMPLE of {n} items", top: int = MAX_BATCH) -> tuple[int, float]:
    """A draw's batch size (``check_count``) and ``beta`` (finite, >= 0).
    The client checks before it sends; the engine checks what it reads."""
    n = check_count(n, what, top)
    beta = float(beta)
    if not 0.0 <= beta < float("inf"):
        raise ReplayError(f"beta must be finite and >= 0, got {beta}")
    return n, beta


# ---- records in a ring ----
def envelope(rec) -> tuple[int, int, int]:
    """(op, table id, seq) of a record."""
    return int(rec["op"]), int(rec["table"]), int(rec["seq"])


def put_record(ring, parts, op, table, seq, a0=0, a1=0, a2=0, f0=0.0, status=0) -> bool:
    """Write one record with ``parts`` (arrays) as its payload; False, with
    nothing written, while the ring or its payload area is full."""
    if ring.room() <= 0:
        return False
    if not parts:
        ring.put(op, table, seq, a0, a1, a2, f0, 0, 0, status)
        return True
    nbytes = 0
    for p in parts:
        nbytes += p.nbytes
    placed = ring.place_payload(nbytes)
    if placed is None:
        return False
    off, view = placed
    pos = 0
    for p in parts:
        b = p.view(np.uint8).reshape(-1)
        view[pos:pos + b.shape[0]] = b
        pos += b.shape[0]
    ring.put(op, table, seq, a0, a1, a2, f0, off, nbytes, status)
    return True


def _deadline_us(rec) -> int:
    return int(rec["a1"])


# ---- requests: the client writes them, the engine reads them ----
def put_reserve(ring, seq: int, table: int, n: int, wait_us: int) -> bool:
    return put_record(ring, (), RESERVE, table, seq, n, wait_us)


def read_reserve(rec) -> tuple[int, int]:
    """(n, timeout in us)."""
    return check_count(rec["a0"], "RESERVE of {n} items"), _deadline_us(rec)


def put_commit(ring, seq: int, table: int, rid: int, n: int, offset: int, prios) -> bool:
    """Commit slots [offset, offset + n) of reservation ``rid``; ``prios``:
    float64[n], or None for the max priority."""
    if prios is None:
        if ring.room() <= 0:
            return False
        ring.put(COMMIT, table, seq, rid, n, offset, 0.0, 0, 0, 0)
        return True
    return put_record(ring, (prios,), COMMIT, table, seq, rid, n, offset)


class CommitRun(NamedTuple):
    table: int
    seq: int        # of the first record
    rid: int
    offset: int
    n: int          # slots of all records together
    prios: np.ndarray | None  # a private copy (the client may rewrite its ring)
    next: int       # index of the first record after the run
    pay_end: int | None


def read_commit_run(ring, i: int, n: int) -> CommitRun:
    """Read COMMIT records i.. (of n pending) that continue one reservation
    as a single commit.  A writer streams a COMMIT per insert call; the
    parts of one lease arrive back to back, and one table update for all
    of them costs about what one part costs."""
    first = ring.peek(i)
    table, rid, offset = int(first["table"]), int(first["a0"]), int(first["a2"])
    with_prios = int(first["pay_len"]) > 0
    if not with_prios:  # single inserts: the whole run in one kernel call (commitrun.py)
        # as uint64: a client may put any 64-bit value in a record
        j, total = commit_run(ring.words(), ring.tail, i, n, np.uint64(table), np.uint64(rid),
                              np.uint64(offset), MAX_BATCH, COMMIT)
        if j < 0:  # record -j - 1 carries a bad count: raise what the loop below raises
            check_count(ring.peek(-j - 1)["a1"], "COMMIT of {n} items", error=ProtocolError)
            raise ProtocolError("a COMMIT's count changed while it was read")  # its writer's doing
        return CommitRun(table, int(first["seq"]), rid, offset, total, None, j, None)
    total, parts, end, j = 0, [], None, i
    while j < n:
        rec = ring.peek(j)
        if j > i and (int(rec["op"]) != COMMIT or int(rec["table"]) != table
                      or int(rec["a0"]) != rid or int(rec["a2"]) != offset + total
                      or (int(rec["pay_len"]) > 0) != with_prios):
            break
        # a COMMIT has no reply to carry a refusal: the client is cut off
        k = check_count(rec["a1"], "COMMIT of {n} items", error=ProtocolError)
        pay = ring.payload_of(rec)
        if with_prios:
            if pay.shape[0] != _F64 * k:
                raise ProtocolError(f"COMMIT of {k} items carries {pay.shape[0]} payload bytes")
            parts.append(pay.view(np.float64))
            end = ring.payload_end(rec)
        total += k
        j += 1
    # a copy, never a view of the payload: the client may rewrite its ring
    # after the table has checked the priorities and before it uses them
    prios = (parts[0].copy() if len(parts) == 1 else np.concatenate(parts)) if with_prios else None
    return CommitRun(table, int(first["seq"]), rid, offset, total, prios, j, end)


def put_abort(ring, seq: int, table: int, rid: int) -> bool:
    return put_record(ring, (), ABORT, table, seq, rid)


def read_abort(rec) -> int:
    return int(rec["a0"])


PROTECT = 1  # SAMPLE flag (a2): pin the drawn slots until the hold is released
# SAMPLE flag (a2): the client copies this batch on every CPU it has (a large
# batch on a small box, client/gather.py): the daemon leaves them to it
# instead of spinning for the learner's next request (server/engine/idle.py)
WIDE = 2


def put_sample(ring, seq: int, table: int, n: int, wait_us: int, beta: float,
               protect: bool = False, wide: bool = False) -> bool:
    flags = (PROTECT if protect else 0) | (WIDE if wide else 0)
    return put_record(ring, (), SAMPLE, table, seq, n, wait_us, flags, beta)


def read_sample(rec) -> tuple[int, int, float, bool, bool]:
    """(n, timeout in us, beta, protect, wide)."""
    n, beta = check_draw(rec["a0"], rec["f0"])
    flags = int(rec["a2"])
    if flags & ~(PROTECT | WIDE):
        raise ProtocolError(f"SAMPLE flags {flags:#x}: only {PROTECT} (protect) and {WIDE} (wide) are defined")
    return n, _deadline_us(rec), beta, bool(flags & PROTECT), bool(flags & WIDE)


def put_release(ring, seq: int, table: int, hid: int) -> bool:
    return put_record(ring, (), RELEASE, table, seq, hid)


def read_release(rec) -> int:
    return int(rec["a0"])


def put_update(ring, seq: int, table: int, keys: np.ndarray, prios: np.ndarray) -> bool:
    return put_record(ring, (keys, prios), UPDATE, table, seq, keys.shape[0])


def read_update(rec, pay: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, priorities), views of the payload."""
    n = check_count(rec["a0"], "UPDATE of {n} keys")
    if pay.shape[0] != (_KEY + _F64) * n:
        raise ProtocolError(f"UPDATE of {n} keys carries {pay.shape[0]} payload bytes")
    return pay[:_KEY * n].view(np.uint64), pay[_KEY * n:].view(np.float64)


def put_flush(ring, seq: int) -> bool:
    return put_record(ring, (), FLUSH, 0, seq)


# ---- replies: the engine builds them, the client reads them ----
class Reply(NamedTuple):
    """A reply waiting in the engine's outbox for room in the client's ring."""
    op: int
    seq: int
    status: int = 0
    a0: int = 0
    a1: int = 0
    a2: int = 0
    parts: tuple = ()


def put_reply(ring, r: Reply) -> bool:
    return put_record(ring, r.parts, r.op, 0, r.seq, r.a0, r.a1, r.a2, 0.0, r.status)


def error_reply(op: int, seq: int, exc: ReplayError) -> Reply:
    return Reply(op, seq, exc.code, parts=(np.frombuffer(str(exc).encode(), np.uint8),))


def reserve_reply(seq: int, rid: int, slots: np.ndarray, contiguous: bool) -> Reply:
    return Reply(RESERVE, seq, 0, rid, int(contiguous), slots.shape[0],
                 (slots.astype(np.uint32),))


def sample_reply(seq: int, keys, probs, weights, hid: int) -> Reply:
    return Reply(SAMPLE, seq, 0, keys.shape[0], hid, 0, (keys, probs, weights))


def flush_reply(seq: int) -> Reply:
    return Reply(FLUSH, seq)


def read_error(rec, pay) -> ReplayError | None:
    """The error a reply carries, or None for success."""
    code = int(rec["status"])
    if not code:
        return None
    return error_from_code(code, bytes(pay).decode("utf-8", "replace"))


def read_reserve_reply(rec, pay) -> tuple[int, bool, np.ndarray]:
    """(reservation id, contiguous, slots as intp)."""
    k = int(rec["a2"])
    if pay.shape[0] != _SLOT * k:
        raise ProtocolError(f"RESERVE reply of {k} slots carries {pay.shape[0]} bytes")
    return int(rec["a0"]), bool(rec["a1"]), pay.view(np.uint32).astype(np.intp)


def read_sample_reply(rec, pay, n: int, rows, keys, probs, weights) -> int:
    """Copy a SAMPLE reply of ``n`` items into keys/probs/weights[rows];
    returns the hold id (0: none)."""
    k = int(rec["a0"])
    if k != n or pay.shape[0] != (_KEY + 2 * _F64) * n:
        raise ProtocolError(f"SAMPLE reply carries {k} items / {pay.shape[0]} bytes, expected {n}")
    keys[rows] = pay[:_KEY * n].view(np.uint64)
    probs[rows] = pay[_KEY * n:(_KEY + _F64) * n].view(np.float64)
    weights[rows] = pay[(_KEY + _F64) * n:].view(np.float64)
    return read_hold(rec)


def read_hold(rec) -> int:
    """The hold id of a SAMPLE reply (0: none)."""
    return int(rec["a1"])

