"""One client's handshake and the descriptors its connection passes.

``Handshake`` owns what ``hello`` makes for a client and what travels to
it as descriptors (SCM_RIGHTS), so none of it ever has a name another
process could open: the client's channel (a sealed memfd) and its two
doorbells (eventfds), held until the lease ends (``release``); the lease
the client held at a dead daemon (``resume``); whether it is an admin
connection with no channel (the command line); and the descriptors the
next reply carries (the channel and doorbells with hello's, a table's
writable rows with a create's or open's: ops.py's ``with_rows``).

Event-loop thread only; one per ``ControlConnection`` (connection.py),
which alone calls it, one request at a time.
"""

from __future__ import annotations

import array
import os
import socket

from ...errors import CapacityError, ProtocolError
from ...wire import records
from ...wire.channel import Channel, ChannelLayout
from ...wire.doorbell import new_doorbell
from ...wire.control import PROTOCOL_VERSION
from ..engine.outbox import ClientState

# a channel holds two of the largest batch each way; 256 records a ring
# lets a client stream commands
CHANNEL = ChannelLayout(req_slots=256, resp_slots=256,
                        req_payload=records.REQUEST_PAYLOAD_BYTES,
                        resp_payload=records.REPLY_PAYLOAD_BYTES)


class Handshake:
    def __init__(self, cid: int, peer, instance: str, daemon_pid: int):
        self.cid, self.peer = cid, peer  # peer: the kernel's word (SO_PEERCRED)
        self.instance, self.daemon_pid = instance, daemon_pid
        self.channel: Channel | None = None
        self.bells: tuple = ()      # (to_daemon, to_client) eventfds
        self.passing: list = []     # descriptors the next reply carries
        self.admin_only = False     # hello without a channel (the command line): no lease
        self.resume = 0             # the lease the client held at a dead daemon (hello)

    def descriptors(self) -> int:
        """The descriptors held now: the channel's memfd until handed over,
        and the channel mapping's own (Python's mmap keeps one) and the
        doorbells until the lease has ended."""
        channel = 0 if self.channel is None else 1 + (self.channel.fd is not None)
        return channel + len(self.bells)

    def hello(self, msg: dict) -> dict:
        """The reply to ``hello``.  An admin connection (no channel): nothing
        to make, no lease.  Else make this client's channel and doorbells;
        they travel with the reply (``send``)."""
        if msg.get("channel", True) is False:
            self.admin_only = True
            return {"protocol": PROTOCOL_VERSION, "daemon_pid": self.daemon_pid, "instance": self.instance,
                    "client_id": self.cid, "max_batch": 0, "fds": []}
        pid, resume = msg["pid"], msg.get("resume", 0)
        if not 0 < pid < 2**32:
            raise ProtocolError(f"hello: pid {pid} is not a process id")
        if not isinstance(resume, int) or isinstance(resume, bool) or not 0 <= resume < 2**64:
            raise ProtocolError(f"hello: resume {resume!r:.40} is not a lease")
        self.resume = resume
        if self.channel is not None:
            raise ProtocolError("hello sent twice")
        try:
            self.channel = Channel.create(CHANNEL, self.peer.pid, self.daemon_pid,
                                          f"shmreplay.{self.instance}.c{self.cid}")
            for _ in range(2):  # one at a time: release closes what was made
                self.bells += (new_doorbell(),)
        except OSError as exc:  # out of descriptors (or memory) past every reserve
            raise CapacityError(f"the daemon cannot make this client's channel now ({exc.strerror}); "
                                "try again when other clients have left") from None
        self.passing = [self.channel.fd, *self.bells]
        return {"protocol": PROTOCOL_VERSION, "daemon_pid": self.daemon_pid, "instance": self.instance,
                "client_id": self.cid, "max_batch": records.MAX_BATCH,
                "fds": ["channel", "to_daemon", "to_client"]}

    def client(self, user: int | None) -> ClientState:
        """At ``ready``: the client the engine serves, with the channel and
        doorbells handed over (``user``: whose reservation cap, None for none)."""
        if self.channel is None or self.passing:
            raise ProtocolError("ready before the channel was handed over")
        # the pid is the kernel's (SO_PEERCRED), not what the client says
        return ClientState(self.cid, self.peer.pid, self.channel, *self.bells, self.resume, user)

    def carry(self, fd: int) -> None:
        """``fd`` travels with the next reply, and is closed then (or by ``unpass``)."""
        self.passing.append(fd)

    def send(self, transport, frame: bytes, hello: bool) -> None:
        """Write a reply with descriptors attached (SCM_RIGHTS): the hello
        reply's channel and doorbells (then close our copy of the channel's
        descriptor), or a table's writable rows (``carry``: then close
        that).  The transport has nothing queued (the client waits for each
        reply), so writing on the socket itself keeps the stream in order."""
        fds, self.passing = self.passing, []
        try:
            if transport.get_write_buffer_size():
                raise ProtocolError("a reply with descriptors would overtake queued bytes")
            sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
            try:
                sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            finally:
                sock.close()
        finally:
            if hello:
                self.channel.handed_over()
            else:
                for fd in fds:
                    os.close(fd)
        if sent < len(frame):
            transport.write(frame[sent:])

    def unpass(self, op: str) -> None:
        """A reply that will not carry the rows descriptor it made (an
        error, a closing connection): close it.  Hello's are the channel's,
        which ``release`` closes."""
        if op != "hello":
            for fd in self.passing:
                os.close(fd)
            self.passing = []

    def release(self) -> None:
        """The lease has ended: unmap the channel, close the doorbells."""
        if self.channel is not None:
            self.channel.release()
        for fd in self.bells:
            os.close(fd)
        self.bells = ()
        self.channel = None
