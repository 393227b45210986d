"""Talking to the daemon below the client API, as a buggy or hostile client
would: raw records on a client's own command pipe (``wire.records``)."""

from shmreplay.wire import records as R


def send_raw(client, op, table=0, a0=0, a1=0, a2=0, f0=0.0, payload=()) -> int:
    """Any record; returns its sequence number."""
    return client._session.pipe.send(R.put_raw, op, table, a0, a1, a2, f0, tuple(payload))


def reserve(table, n: int, wait_s: float = 0.0):
    """RESERVE n slots outside any lease: (rid, contiguous, slots)."""
    pipe = table.client._session.pipe
    return pipe.wait(pipe.send(R.put_reserve, table.id, n, R.timeout_us(wait_s)),
                     R.read_reserve_reply, wait_s)


def commit(table, rid: int, n: int, offset: int = 0, prios=None) -> None:
    table.client._session.pipe.send(R.put_commit, table.id, rid, n, offset, prios)
