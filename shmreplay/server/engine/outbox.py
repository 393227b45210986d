"""An attached client as the engine sees it: its channel, its two doorbells
(eventfds: ``to_daemon`` it rings, ``to_client`` we ring), and the replies
waiting for room in its ring.

Replies are queued (``respond``) and written when the ring has room
(``flush``), so a client slow to read never blocks the engine; one that
leaves MAX_OUTBOX replies unread is cut off (``ProtocolError``).  Whatever
the client wrote into its ring's control words is checked before use.

Engine thread only.
"""

from __future__ import annotations

import collections

from ...errors import ProtocolError
from ...wire.channel import Channel
from ...wire.doorbell import ring as ring_bell
from ...wire.peer import process_start
from ...wire.records import Reply, put_reply

MAX_OUTBOX = 1024  # replies a client may leave unread before it is cut off


class ClientState:
    def __init__(self, cid: int, pid: int, channel: Channel, to_daemon: int, to_client: int,
                 resume: int = 0, user: int | None = None):
        self.id = cid
        self.pid = pid
        self.user = user  # its uid, if its reservations count against a user cap (tables/slots/reservations.py)
        self.start = process_start(pid)  # with the pid, names this process in lease records
        self.resume = resume  # the lease it held at a dead daemon (records.owner_key), or 0
        self.channel = channel
        self.req = channel.requests
        self.resp = channel.responses
        self.to_daemon, self.to_client = to_daemon, to_client
        self.outbox: collections.deque = collections.deque()
        self.uses: dict[int, int] = {}  # table id -> USES_WRITE | USES_SAMPLE (commands.py), for status
        self.samples = False  # it has sent a SAMPLE: the engine serves it between writers (engine.py)

    def respond(self, reply: Reply) -> None:
        self.outbox.append(reply)
        if len(self.outbox) > MAX_OUTBOX:
            raise ProtocolError(f"client left {MAX_OUTBOX} responses unread")

    def flush(self) -> None:
        """Write what fits of the outbox and wake the client if it sleeps."""
        ring = self.resp
        wrote = 0
        if ring.room() < 0:  # the client scribbled its tail
            raise ProtocolError("response ring tail moved to an impossible position")
        while self.outbox:
            if not put_reply(ring, self.outbox[0]):
                break
            self.outbox.popleft()
            wrote += 1
        if wrote and ring.publish():
            ring_bell(self.to_client)

    def detach(self) -> None:
        """Drop the views of the channel, so the control plane can unmap it."""
        self.outbox.clear()
        self.channel = self.req = self.resp = None
