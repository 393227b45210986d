"""One client's control connection, on the daemon's event-loop thread.

``ControlConnection`` owns the connection itself: its transport, the
sans-IO rules around it (``wire.control.ServerConnection``), the queue of
its requests and the one task that answers them in order (ops.py, one
handler per op), the handshake's deadline, and its lease: at ``ready`` it
hands the client to the engine, and when the connection closes, for any
reason, it ends the lease.  What the handshake makes and the descriptors a
reply carries are its ``Handshake``'s (handshake.py).

Made by the gate (gate.py) for a client it admitted, from who connected
(SO_PEERCRED), and counted under the limits from then on (connections.py).
Event-loop thread only: asyncio calls the protocol methods, the engine
thread reaches it only through ``ControlServer.on_client_error``.
"""

from __future__ import annotations

import asyncio
import logging

from ...errors import DaemonUnavailable, ProtocolError, ReplayError
from ...wire import control as protocol
from . import access, ops
from .handshake import Handshake

log = logging.getLogger("shmreplayd.control")


class ControlConnection(asyncio.Protocol):
    def __init__(self, server, peer: access.Peer):  # a control.ControlServer
        self.srv = server
        self.peer = peer  # the kernel's word (SO_PEERCRED), read by the gate that admitted it
        # counted under the limits from admission on, before its transport exists
        self.cid = server.connections.admit(self)
        self.handshake = Handshake(self.cid, peer, server.cfg.instance, server.pid)
        self.conn = protocol.ServerConnection()
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker: asyncio.Task | None = None
        self.attached = False
        self.closed = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport) -> None:
        self.transport = transport
        loop = asyncio.get_running_loop()
        self.worker = loop.create_task(self._work())
        loop.call_later(self.srv.cfg.handshake_timeout_s, self._handshake_overdue)
        if self.srv.gate.closed:  # admitted just before the stop: kicked with everyone else
            self.kick(DaemonUnavailable("daemon is shutting down"))

    def abandon(self) -> None:
        """Its transport could not be made (gate.py): it holds nothing."""
        self.closed = True
        self.srv.connections.lost(self.cid)
        self.srv.gate.left(self)

    def descriptors(self) -> int:
        """The descriptors this connection holds now (gate.py counts them):
        its socket until the connection is lost, and its handshake's."""
        return (not self.closed) + self.handshake.descriptors()

    def _handshake_overdue(self) -> None:
        """A connection holds a place under max_clients: one that never
        completes its handshake may not hold it for ever."""
        if not self.attached and not self.handshake.admin_only and not self.closed:
            log.warning("connection %d (pid %d, uid %d): no handshake within %.3g s; closing it",
                        self.cid, self.peer.pid, self.peer.uid, self.srv.cfg.handshake_timeout_s)
            self.kick(ProtocolError(f"no hello and ready within {self.srv.cfg.handshake_timeout_s:g} s"))

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            for msg in self.conn.receive(data):
                self.queue.put_nowait(msg)
        except ProtocolError as exc:
            log.warning("connection %d: %s; closing it", self.cid, exc)
            self.kick(exc)

    def connection_lost(self, exc) -> None:
        if not self.srv.connections.lost(self.cid):
            return  # abandoned: nothing was set up
        self.closed = True
        if self.worker is not None:
            self.worker.cancel()
        self.srv.connections.lease_ending(asyncio.get_running_loop().create_task(self._end_lease()))

    def kick(self, exc: BaseException) -> None:
        """Send a bye notice and close (rule 4)."""
        if self.transport is not None and not self.transport.is_closing():
            try:
                self.transport.write(protocol.notice_bye(exc))
            except ProtocolError:
                pass
            self.transport.close()

    # ---- requests ----
    async def _work(self) -> None:
        hs = self.handshake
        while True:
            msg = await self.queue.get()
            rid = msg["id"]
            try:
                result = await ops.dispatch(self, msg)
                frame = protocol.reply_ok(rid, **(result or {}))
            except ReplayError as exc:
                frame = protocol.reply_error(rid, exc)
                hs.unpass(msg["op"])
            except Exception as exc:  # a bug must not take the daemon down
                log.exception("connection %d: %s failed", self.cid, msg.get("op"))
                frame = protocol.reply_error(rid, ReplayError(f"internal error: {exc}"))
                hs.unpass(msg["op"])
            if self.transport.is_closing():
                hs.unpass(msg["op"])
                return
            if hs.passing:
                try:
                    hs.send(self.transport, frame, msg["op"] == "hello")
                except (OSError, ProtocolError) as exc:
                    log.warning("connection %d: could not pass its descriptors: %s", self.cid, exc)
                    self.kick(ProtocolError(f"could not pass the descriptors: {exc}"))
                    return
            else:
                self.transport.write(frame)

    # ---- the lease ----
    async def attach(self) -> None:
        """``ready``: the engine serves the client from now on."""
        # root, the daemon's user and the admin group hold no user cap on reservations
        user = None if access.may_administer(self.srv.cfg, self.peer) else self.peer.uid
        cl = self.handshake.client(user)
        # attached before the await: if the connection drops meanwhile this
        # task is cancelled, and _end_lease must still detach (engine calls
        # run in order, so the detach follows the add if the add ran)
        self.attached = True
        await self.srv.call(self.srv.engine.add_client, cl)
        log.debug("client %d (pid %d) attached", self.cid, self.peer.pid)

    async def _end_lease(self) -> None:
        if self.attached:
            cl = await self.srv.call(self.srv.engine.detach_client, self.cid)
            if cl is not None:  # drop its views so the unmap below succeeds
                cl.detach()
        self.handshake.release()
        # the cancelled worker's traceback holds frames that hold us: break
        # the cycle, so its channel is unmapped now, not at some later GC
        self.worker = None
        self.srv.gate.left(self)
        log.debug("connection %d closed", self.cid)
