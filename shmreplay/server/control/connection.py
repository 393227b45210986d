"""One client's control connection, on the daemon's event-loop thread.

``ControlConnection`` wraps ``wire.control.ServerConnection`` (the sans-IO
rules) around a transport, for a client the gate (gate.py) admitted from
who connected (SO_PEERCRED); answers its requests in order from one task; at ``hello`` makes the
client's channel (a sealed memfd) and doorbells (eventfds) and passes them
with the reply (SCM_RIGHTS), so they never have a name; at ``ready``
hands the client to the engine; and when the connection closes, for any
reason, ends the client's lease.  Table and admin work goes to the
``ControlServer`` (server.py).
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket

from ...errors import CapacityError, DaemonUnavailable, PermissionDenied, ProtocolError, ReplayError
from ...schema import check_table_name
from ...wire import control as protocol
from ...wire import records
from ...wire.channel import Channel, ChannelLayout, new_doorbell
from ...wire.control import ADMIN_OPS, PROTOCOL_VERSION
from ..engine.outbox import ClientState
from . import access

log = logging.getLogger("shmreplayd.control")

# a channel holds two of the largest batch each way; 256 records a ring
# lets a client stream commands
CHANNEL = ChannelLayout(req_slots=256, resp_slots=256,
                        req_payload=records.REQUEST_PAYLOAD_BYTES,
                        resp_payload=records.REPLY_PAYLOAD_BYTES)



class ControlConnection(asyncio.Protocol):
    def __init__(self, server, peer: access.Peer):  # a control.ControlServer
        self.srv = server
        self.cid = server.next_cid
        server.next_cid += 1
        self.conn = protocol.ServerConnection()
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker: asyncio.Task | None = None
        self.channel: Channel | None = None
        self.bells: tuple = ()      # (to_daemon, to_client) eventfds
        self.passing: list = []     # descriptors the hello reply carries
        self.admin_only = False     # hello without a channel (the command line): no lease
        self.resume = 0             # the lease the client held at a dead daemon (hello)
        self.peer = peer  # the kernel's word (SO_PEERCRED), read by the gate that admitted it
        self.attached = False
        self.closed = False
        # counted under the limits from admission on, before its transport exists
        server.connections[self.cid] = self

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
        self.srv.connections.pop(self.cid, None)
        self.srv.gate.left(self)

    def descriptors(self) -> int:
        """The descriptors this connection holds now (gate.py counts them):
        its socket until the connection is lost; its channel's memfd until
        handed over, and the channel mapping's own (Python's mmap keeps one)
        and its doorbells until the lease has ended."""
        channel = 0 if self.channel is None else 1 + (self.channel.fd is not None)
        return (self.cid in self.srv.connections) + channel + len(self.bells)

    def _handshake_overdue(self) -> None:
        """A connection holds a place under max_clients: one that never
        completes its handshake may not hold it for ever."""
        if not self.attached and not self.admin_only and not self.closed:
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
        if self.cid not in self.srv.connections:
            return  # abandoned: nothing was set up
        self.closed = True
        self.srv.connections.pop(self.cid, None)
        if self.worker is not None:
            self.worker.cancel()
        task = asyncio.get_running_loop().create_task(self._end_lease())
        self.srv.detaching.add(task)
        task.add_done_callback(self.srv.detaching.discard)

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
        while True:
            msg = await self.queue.get()
            rid = msg["id"]
            try:
                result = await self._dispatch(msg)
                frame = protocol.reply_ok(rid, **(result or {}))
            except ReplayError as exc:
                frame = protocol.reply_error(rid, exc)
                unpass(self, msg["op"])
            except Exception as exc:  # a bug must not take the daemon down
                log.exception("connection %d: %s failed", self.cid, msg.get("op"))
                frame = protocol.reply_error(rid, ReplayError(f"internal error: {exc}"))
                unpass(self, msg["op"])
            if self.transport.is_closing():
                unpass(self, msg["op"])
                return
            if self.passing:
                try:
                    self._send_with_fds(frame, msg["op"] == "hello")
                except (OSError, ProtocolError) as exc:
                    log.warning("connection %d: could not pass its descriptors: %s", self.cid, exc)
                    self.kick(ProtocolError(f"could not pass the descriptors: {exc}"))
                    return
            else:
                self.transport.write(frame)

    async def _dispatch(self, msg: dict) -> dict | None:
        op = msg["op"]
        if op in ADMIN_OPS and not access.may_administer(self.srv.cfg, self.peer):
            raise PermissionDenied(f"{op} is an admin operation: only the daemon's user, root or "
                                   f"the admin_group may run it (you are uid {self.peer.uid})")
        handler = self.HANDLERS.get(op)
        if handler is None:
            raise ProtocolError(f"op {op!r} has no handler")
        return await handler(self, msg)

    # ---- handlers: one per op ----
    async def _on_hello(self, msg: dict) -> dict:
        if msg.get("channel", True) is False:  # an admin connection: nothing to make, no lease
            self.admin_only = True
            cfg = self.srv.cfg
            return {"protocol": PROTOCOL_VERSION, "daemon_pid": self.srv.pid, "instance": cfg.instance,
                    "client_id": self.cid, "max_batch": 0, "fds": []}
        return self._hello(msg["pid"], msg.get("resume", 0))

    async def _on_ready(self, msg: dict) -> None:
        await self._ready()

    async def _on_create_table(self, msg: dict) -> dict:
        return await with_rows(self, await self.srv.create_table(msg["spec"], msg["exist_ok"], self.peer))

    async def _on_open_table(self, msg: dict) -> dict:
        return await with_rows(self, await self.srv.open_table(check_table_name(msg["name"])))

    async def _on_drop_table(self, msg: dict) -> None:
        await self.srv.drop_table(msg["name"])

    async def _on_list_tables(self, msg: dict) -> dict:
        return {"tables": await self.srv.call(self.srv.engine.describe)}

    async def _on_status(self, msg: dict) -> dict:
        return await self.srv.status(self.peer)  # another user's clients: counts only (seen.py)

    async def _on_checkpoint(self, msg: dict) -> dict:
        return {"checkpoints": await self.srv.checkpoint(_names(msg, "checkpoint"), msg["to"])}

    async def _on_sync(self, msg: dict) -> dict:
        return {"syncs": await self.srv.sync(_names(msg, "sync"))}

    async def _on_shutdown(self, msg: dict) -> None:
        log.info("shutdown requested by pid %d (uid %d)", self.peer.pid, self.peer.uid)
        self.srv.request_shutdown()

    # every op of wire.control.REQUESTS, which checked the message's fields
    HANDLERS = {"hello": _on_hello, "ready": _on_ready, "create_table": _on_create_table,
                "open_table": _on_open_table, "drop_table": _on_drop_table,
                "list_tables": _on_list_tables, "stats": _on_status, "status": _on_status,
                "checkpoint": _on_checkpoint, "sync": _on_sync, "shutdown": _on_shutdown}

    def _hello(self, pid: int, resume) -> dict:
        """Make this client's channel and doorbells; they travel with the
        reply (``_send_with_fds``), never under a name another process could
        open."""
        cfg, srv = self.srv.cfg, self.srv
        if not 0 < pid < 2**32:
            raise ProtocolError(f"hello: pid {pid} is not a process id")
        if not isinstance(resume, int) or isinstance(resume, bool) or not 0 <= resume < 2**64:
            raise ProtocolError(f"hello: resume {resume!r:.40} is not a lease")
        self.resume = resume
        if self.channel is not None:
            raise ProtocolError("hello sent twice")
        try:
            self.channel = Channel.create(CHANNEL, self.peer.pid, srv.pid,
                                          f"shmreplay.{cfg.instance}.c{self.cid}")
            for _ in range(2):  # one at a time: _end_lease closes what was made
                self.bells += (new_doorbell(),)
        except OSError as exc:  # out of descriptors (or memory) past every reserve
            raise CapacityError(f"the daemon cannot make this client's channel now ({exc.strerror}); "
                                "try again when other clients have left") from None
        self.passing = [self.channel.fd, *self.bells]
        return {"protocol": PROTOCOL_VERSION, "daemon_pid": srv.pid, "instance": cfg.instance,
                "client_id": self.cid, "max_batch": records.MAX_BATCH,
                "fds": ["channel", "to_daemon", "to_client"]}

    async def _ready(self) -> None:
        if self.channel is None or self.passing:
            raise ProtocolError("ready before the channel was handed over")
        # the pid is the kernel's (SO_PEERCRED), not what the client says
        # root, the daemon's user and the admin group hold no user cap on reservations
        user = None if access.may_administer(self.srv.cfg, self.peer) else self.peer.uid
        cl = ClientState(self.cid, self.peer.pid, self.channel, *self.bells, self.resume, user)
        # attached before the await: if the connection drops meanwhile this
        # task is cancelled, and _end_lease must still detach (engine calls
        # run in order, so the detach follows the add if the add ran)
        self.attached = True
        await self.srv.call(self.srv.engine.add_client, cl)
        log.debug("client %d (pid %d) attached", self.cid, self.peer.pid)

    def _send_with_fds(self, frame: bytes, hello: bool) -> None:
        """Write a reply with descriptors attached (SCM_RIGHTS): the hello
        reply's channel and doorbells (then close our copy of the channel's
        descriptor), or a table's writable rows (``with_rows``: then close
        that).  The transport has nothing queued (the client waits for each
        reply), so writing on the socket itself keeps the stream in order."""
        fds, self.passing = self.passing, []
        try:
            if self.transport.get_write_buffer_size():
                raise ProtocolError("a reply with descriptors would overtake queued bytes")
            sock = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
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
            self.transport.write(frame[sent:])

    async def _end_lease(self) -> None:
        if self.attached:
            cl = await self.srv.call(self.srv.engine.detach_client, self.cid)
            if cl is not None:  # drop its views so the unmap below succeeds
                cl.detach()
        if self.channel is not None:
            self.channel.release()
        for fd in self.bells:
            os.close(fd)
        self.bells = ()
        # the cancelled worker's traceback holds frames that hold us: break
        # the cycle, so its channel is unmapped now, not at some later GC
        self.worker = self.channel = None
        self.srv.gate.left(self)
        log.debug("connection %d closed", self.cid)


async def with_rows(conn: ControlConnection, desc: dict) -> dict:
    """The reply to a create or open.  A table only its creator writes
    (``writers="creator"``) has rows the group may only read: its
    creator, or an admin, who is not the daemon's user gets a writable
    descriptor of them with the reply (SCM_RIGHTS), so no name of them
    is writable by anyone else.  A new open file description (reopened
    through /proc), so nothing the client sets on it (``fcntl``) reaches
    the daemon's own."""
    uid = desc["spec"].get("writer_uid")
    if uid is None or access.is_owner(conn.peer.uid) or not (
            uid == conn.peer.uid or access.may_administer(conn.srv.cfg, conn.peer)):
        return {"table": desc}
    table = await conn.srv.call(conn.srv.engine.table_named, desc["spec"]["name"])
    try:
        fd = os.open(f"/proc/self/fd/{table.map.rows.fd}", os.O_RDWR | os.O_CLOEXEC)
    except (OSError, TypeError) as exc:  # out of descriptors; the table dropped meanwhile
        raise CapacityError(f"the daemon cannot pass the rows of table {desc['spec']['name']!r} "
                            f"now ({exc}); try again") from None
    conn.passing.append(fd)
    return {"table": desc, "fds": ["rows"]}


def unpass(conn: ControlConnection, op: str) -> None:
    """A reply that will not carry the rows descriptor it made (an
    error, a closing connection): close it.  Hello's are the channel's,
    which ``ControlConnection._end_lease`` closes."""
    if op != "hello":
        for fd in conn.passing:
            os.close(fd)
        conn.passing = []


def _names(msg: dict, op: str) -> list:
    if not all(isinstance(n, str) for n in msg["tables"]):
        raise ProtocolError(f"{op}: 'tables' must be a list of names")
    return msg["tables"]

