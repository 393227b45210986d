"""The daemon's open connections, by client id: the ids handed out, the
connections counted under the client limits, kicking one or all, and the
lease ends still running after their connections closed.

A connection is counted from its admission (before its transport exists:
the gate, gate.py, admits it) until it is lost or abandoned
(connection.py); its lease's end runs on as a task of its own, which the
stop waits for.  The gate keeps its own list of what still holds
descriptors (until the lease has ended).

Event-loop thread only; the ``ControlServer`` (server.py) owns one.  The
engine thread reaches it only through ``ControlServer.on_client_error``,
which hands a kick to the loop.
"""

from __future__ import annotations

import asyncio


class Connections:
    def __init__(self):
        self.open: dict[int, object] = {}  # client id -> its ControlConnection (connection.py)
        self.next_cid = 1
        self.ending: set[asyncio.Task] = set()  # leases ending (connection.py's end_lease)

    def admit(self, conn) -> int:
        """Count ``conn`` under the limits from now on; its client id."""
        cid = self.next_cid
        self.next_cid += 1
        self.open[cid] = conn
        return cid

    def lost(self, cid: int) -> bool:
        """The connection closed (or its transport could not be made): it is
        counted no more.  False if it was not counted (closed already)."""
        return self.open.pop(cid, None) is not None

    def lease_ending(self, task: asyncio.Task) -> None:
        """A closed connection's lease ends in ``task``: the stop waits for it."""
        self.ending.add(task)
        task.add_done_callback(self.ending.discard)

    def __len__(self) -> int:
        return len(self.open)

    def __iter__(self):
        return iter(list(self.open.values()))

    def uid_of(self, cid: int) -> int | None:
        """The user (the kernel's word) of an open connection; None if it is gone."""
        conn = self.open.get(cid)
        return None if conn is None else conn.peer.uid

    def kick(self, cid: int, exc: BaseException) -> None:
        """Tell client ``cid`` why, and close its connection (if still open)."""
        conn = self.open.get(cid)
        if conn is not None:
            conn.kick(exc)

    async def close(self, bye: BaseException) -> None:
        """Kick every client, then wait until every lease has ended."""
        for conn in self:
            conn.kick(bye)
        while self.ending:
            await asyncio.gather(*self.ending, return_exceptions=True)
