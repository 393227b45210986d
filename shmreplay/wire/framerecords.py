"""A frame table's records (docs/frames.md), beside ``records.py``'s, in the
same rings and the same record layout (``records.RECORD``):

=============  ====================================  ==========================================
op             request                               reply
=============  ====================================  ==========================================
FRAMES         a0 = ring (the base field's index     a0 = lease id (0: none free), a2 = k;
               among the table's bases), a1 = n      payload uint32[k] frames (k <= n)
FRAMES_BACK    a0 = lease id                         no reply; the lease's frames that no
                                                     slot references are free again
FCOMMIT        a0 = reservation id, a1 = n,          no reply (as COMMIT); a frame table's
               a2 = offset, f0 = 1.0 if priorities   items are committed only this way
               come first; payload [float64[n]
               priorities] uint32[n, refs an item]
=============  ====================================  ==========================================

They need no new channel version: only a daemon that serves frame tables
creates one, and a client sends them only for such a table; the engine
cuts off a client that sends one for a table of rows, or a COMMIT to a
frame table.  The engine
decodes what a client wrote into shared memory: every ``read_*`` bounds
its counts and payload sizes, raises ``ProtocolError`` (the client is cut
off) before any value is used, and returns private copies of payloads (a
client may rewrite its ring after the check).

Pure functions over a ring (``channel.Ring``), called by whichever thread
owns that end of it.
"""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from .records import MAX_BATCH, Reply, check_count, put_record

FRAMES, FRAMES_BACK, FCOMMIT = 8, 9, 10
# frames one lease may ask for: a writer asks for a stream's next few dozen;
# more in one record is a client out of its protocol (the frame side of a
# table, server/tables/frames/tableframes.py, holds a lease to it too)
MAX_LEASE_FRAMES = 4096
_F64, _REF = 8, 4


def put_frames(ring, seq: int, table: int, base: int, n: int) -> bool:
    return put_record(ring, (), FRAMES, table, seq, base, n)


def read_frames(rec) -> tuple[int, int]:
    """(ring, n)."""
    return int(rec["a0"]), check_count(rec["a1"], "FRAMES lease of {n} frames", MAX_LEASE_FRAMES)


def frames_reply(seq: int, lid: int, frames: np.ndarray) -> Reply:
    return Reply(FRAMES, seq, 0, lid, 0, frames.shape[0], (frames.astype(np.uint32),))


def read_frames_reply(rec, pay) -> tuple[int, np.ndarray]:
    """(lease id, frames as intp)."""
    k = int(rec["a2"])
    if pay.shape[0] != _REF * k:
        raise ProtocolError(f"FRAMES reply of {k} frames carries {pay.shape[0]} bytes")
    return int(rec["a0"]), pay.view(np.uint32).astype(np.intp)


def put_frames_back(ring, seq: int, table: int, lid: int) -> bool:
    return put_record(ring, (), FRAMES_BACK, table, seq, lid)


def read_frames_back(rec) -> int:
    return int(rec["a0"])


def put_fcommit(ring, seq: int, table: int, rid: int, offset: int, refs: np.ndarray,
                prios: np.ndarray | None = None) -> bool:
    """Commit slots [offset, offset + n) of reservation ``rid`` with their
    frame references ``refs`` (uint32[n, refs an item]) and ``prios``
    (float64[n], or None for the max priority)."""
    n = refs.shape[0]
    parts = (refs,) if prios is None else (prios, refs)
    return put_record(ring, parts, FCOMMIT, table, seq, rid, n, offset, 0.0 if prios is None else 1.0)


def read_fcommit(rec, pay, refs_per_item: int):
    """(reservation id, n, offset, priorities or None, references): the
    payload's copies, checked to be exactly what the record says."""
    n = check_count(rec["a1"], "FCOMMIT of {n} items", MAX_BATCH, error=ProtocolError)
    flag = float(rec["f0"])
    if flag not in (0.0, 1.0):
        raise ProtocolError(f"FCOMMIT flag {flag}: 1.0 (priorities first) or 0.0 (none)")
    head = _F64 * n if flag else 0
    if pay.shape[0] != head + _REF * n * refs_per_item:
        raise ProtocolError(f"FCOMMIT of {n} items of {refs_per_item} frame references carries "
                            f"{pay.shape[0]} payload bytes")
    prios = pay[:head].view(np.float64).copy() if flag else None
    refs = pay[head:].view(np.uint32).reshape(n, refs_per_item).copy()
    return int(rec["a0"]), n, int(rec["a2"]), prios, refs
