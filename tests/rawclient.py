"""Talking to the daemon below the client API, as a buggy or hostile client
would: raw records on a client's own command pipe (``wire.records``)."""

import numpy as np

from shmreplay.wire import records as R


def send_raw(client, op, table=0, a0=0, a1=0, a2=0, f0=0.0, payload=()) -> int:
    """Any record; returns its sequence number."""
    return client._session.pipe.send(put_raw, op, table, a0, a1, a2, f0, tuple(payload))


def put_raw(ring, seq: int, op: int, table: int, a0: int = 0, a1: int = 0, a2: int = 0,
            f0: float = 0.0, parts: tuple = ()) -> bool:
    """Any record at all, as a misbehaving client could write it: straight
    into the ring (``wire.channel.Ring``), past the codec whose checks the
    daemon must not count on.  False, with nothing written, while the ring
    or its payload area is full (``pipe.send`` then retries)."""
    data = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    if ring.room() <= 0:
        return False
    placed = ring.place_payload(len(data))
    if placed is None:
        return False
    off, view = placed
    view[:] = np.frombuffer(data, np.uint8)
    ring.put(op, table, seq, a0, a1, a2, f0, off, len(data), 0)
    return True


def reserve(table, n: int, wait_s: float = 0.0):
    """RESERVE n slots outside any lease: (rid, contiguous, slots)."""
    pipe = table.client._session.pipe
    return pipe.wait(pipe.send(R.put_reserve, table.id, n, R.timeout_us(wait_s)),
                     R.read_reserve_reply, wait_s)


def commit(table, rid: int, n: int, offset: int = 0, prios=None) -> None:
    table.client._session.pipe.send(R.put_commit, table.id, rid, n, offset, prios)
