"""The daemon's control plane: a Unix-socket server on asyncio/uvloop.

Runs on the daemon's event-loop thread.  One ``ControlConnection`` per
client wraps ``wire.control.ServerConnection`` (the sans-IO rules) around a
transport.  Requests of one connection are answered in order by one task;
anything that touches tables runs on the engine thread, through the
engine's named entry points (``ControlServer.call``); slow work (creating
a multi-GiB segment, writing a checkpoint) runs in the default executor so
the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import posix_ipc

from ..errors import (CapacityError, DaemonUnavailable, PermissionDenied, ProtocolError,
                      ReplayError, TableExists, UnknownTable)
from ..schema import check_table_name, spec_from_wire
from ..wire import control as protocol
from ..wire import names, records
from ..wire.channel import Channel, ChannelLayout
from ..wire.control import ADMIN_OPS, PROTOCOL_VERSION
from ..wire.layout import TableMap
from ..wire.segment import create_semaphore, unlink_semaphore_quiet
from . import access, checkpoint, recovery
from .config import DaemonConfig
from .engine import Engine
from .outbox import ClientState
from .table import Table

log = logging.getLogger("shmreplayd.control")

# a refused connection is closed when the client speaks, or after this long
REFUSED_LINGER_S = 10.0

# a channel holds two of the largest batch each way; 256 records a ring
# lets a client stream commands
CHANNEL = ChannelLayout(req_slots=256, resp_slots=256,
                        req_payload=records.REQUEST_PAYLOAD_BYTES,
                        resp_payload=records.REPLY_PAYLOAD_BYTES)


class ControlServer:
    def __init__(self, cfg: DaemonConfig, engine: Engine):
        self.cfg = cfg
        self.engine = engine
        self.pid = os.getpid()
        self.started = time.time()
        self.connections: dict[int, ControlConnection] = {}
        self.next_cid = 1
        self.next_table_id = 1
        self.creating: set[str] = set()
        self.server: asyncio.AbstractServer | None = None
        self.path: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.detaching: set[asyncio.Task] = set()
        self.checkpointing = asyncio.Lock()
        self.adopted: set[str] = set()  # tables taken over from a dead daemon
        self.request_shutdown = lambda: None  # set by the Daemon

    async def start(self, path: str) -> None:
        self.loop = asyncio.get_running_loop()
        _claim_socket_path(path)
        self.server = await self.loop.create_unix_server(lambda: ControlConnection(self), path=path)
        os.chmod(path, self.cfg.segment_mode)
        os.chown(path, -1, self.cfg.gid)
        self.path = path

    async def close(self) -> None:
        """Stop accepting, tell every client, end every lease."""
        if self.server is not None:
            self.server.close()
        bye = DaemonUnavailable("daemon is shutting down")
        for conn in list(self.connections.values()):
            conn.kick(bye)
        while self.detaching:
            await asyncio.gather(*list(self.detaching), return_exceptions=True)
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # called from the engine thread
    def on_client_error(self, cid: int, exc: BaseException) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._kick, cid, exc)

    def _kick(self, cid: int, exc: BaseException) -> None:
        conn = self.connections.get(cid)
        if conn is not None:
            conn.kick(exc)

    async def call(self, fn, *args):
        return await asyncio.wrap_future(self.engine.submit(fn, *args))

    # ---- table management ----
    async def create_table(self, wire: dict, exist_ok: bool) -> dict:
        spec = spec_from_wire(wire)
        existing = await self.call(self.engine.describe, spec.name)
        if existing is not None:
            if exist_ok and spec_from_wire(existing["spec"]) == spec:
                return existing
            raise TableExists(f"table {spec.name!r} exists already"
                              + (" with a different schema" if exist_ok else ""))
        if spec.name in self.creating:
            raise TableExists(f"table {spec.name!r} is being created by another client")
        count = len(await self.call(self.engine.table_names))
        if count + len(self.creating) >= self.cfg.max_tables:
            raise CapacityError(f"the daemon serves {count} tables, its limit (max_tables "
                                f"{self.cfg.max_tables}); drop one or raise the limit")
        self.creating.add(spec.name)
        try:
            return await self.add_table(spec)
        finally:
            self.creating.discard(spec.name)

    async def add_table(self, spec, tmap: TableMap | None = None, recover: bool = False) -> dict:
        """Serve a table: a new segment, or ``tmap`` (adopted or restored,
        ``recover``: rebuild the table from what it holds)."""
        name = names.table_segment(self.cfg.instance, spec.name)
        t0 = time.monotonic()
        fresh = tmap is None
        if fresh:
            tmap = await self.loop.run_in_executor(None, TableMap.create, name, spec,
                                                   self.cfg.segment_mode, self.cfg.gid)
        seed = None if self.cfg.seed is None else self.cfg.seed + self.next_table_id
        try:
            if recover:
                table = recovery.rebuild(self.next_table_id, spec, tmap, seed,
                                         self.cfg.recovery_quarantine_s, self.cfg.hold_timeout_s)
            else:
                table = Table(self.next_table_id, spec, tmap, seed, hold_timeout_s=self.cfg.hold_timeout_s)
        except BaseException:
            if fresh:  # an adopted or restored segment is the caller's to keep or drop
                tmap.seg.unlink()
            tmap.release()
            raise
        self.next_table_id += 1
        await self.call(self.engine.add_table, table)
        log.info("table %s: %d x %d bytes in %s (%.1f MiB, ready in %.2f s)", spec.name,
                 spec.capacity, spec.item_bytes, name, tmap.layout.size / 2**20, time.monotonic() - t0)
        return table.describe()

    async def drop_table(self, name: str, unlink: bool = True) -> None:
        check_table_name(name)
        table = await self.call(self.engine.drop_table, name)
        if unlink:
            table.map.seg.unlink()
        table.map.release()
        log.info("table %s %s", name, "dropped" if unlink else "left in /dev/shm for the next daemon")

    async def drop_all_tables(self, unlink: bool = True, keep_adopted: bool = False) -> None:
        for name in await self.call(self.engine.table_names):
            await self.drop_table(name, unlink and not (keep_adopted and name in self.adopted))

    async def checkpoint(self, names: list, directory: str, keep: int = 0) -> list[dict]:
        """Checkpoint tables (all if ``names`` is empty) into ``directory``,
        one at a time; inserts and samples pause only for each snapshot."""
        if not os.path.isabs(directory):
            raise ReplayError(f"checkpoint directory must be an absolute path, got {directory!r}")
        reports = []
        async with self.checkpointing:
            if not names:
                names = sorted(await self.call(self.engine.table_names))
            for name in names:
                table = await self.call(self.engine.table_named, check_table_name(name))
                bufs = await self.loop.run_in_executor(None, checkpoint.buffers, table.spec.capacity)
                snap = await self.call(checkpoint.snapshot, table, bufs)
                try:
                    rep = await self.loop.run_in_executor(
                        None, checkpoint.write, snap, directory, keep,
                        int(self.cfg.checkpoint_buffer_mb * 2**20))
                except OSError as exc:
                    raise ReplayError(f"checkpoint of table {name!r} into {directory} failed: {exc}")
                log.info("checkpoint of table %s: %d items (%d evicted during the copy), %.1f MiB "
                         "in %.2f s to %s; engine paused %.2f ms", name, rep["items"], rep["dropped"],
                         rep["bytes"] / 2**20, rep["write_s"], rep["path"], 1e3 * rep["pause_s"])
                reports.append(rep)
        return reports

    async def status(self) -> dict:
        snap = await self.call(self.engine.snapshot)
        return {"daemon_pid": self.pid, "protocol": PROTOCOL_VERSION, "instance": self.cfg.instance,
                "socket": self.path, "uptime_s": time.time() - self.started,
                "connections": len(self.connections), **snap}


class ControlConnection(asyncio.Protocol):
    def __init__(self, server: ControlServer):
        self.srv = server
        self.cid = server.next_cid
        server.next_cid += 1
        self.conn = protocol.ServerConnection()
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker: asyncio.Task | None = None
        self.channel: Channel | None = None
        self.sem: posix_ipc.Semaphore | None = None
        self.peer: access.Peer | None = None
        self.attached = False
        self.closed = False
        self.refused = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport) -> None:
        self.transport = transport
        srv = self.srv
        try:
            self.peer = access.peer_of(transport.get_extra_info("socket"))
        except OSError as exc:
            log.warning("connection %d: cannot read its credentials (%s); closing it", self.cid, exc)
            transport.close()
            return
        refusal = None
        if not access.may_connect(srv.cfg, self.peer):
            refusal = PermissionDenied(
                f"user {self.peer.uid} may not use this daemon (not its user, not in "
                "allowed_users, not in allowed_groups)")
        elif len(srv.connections) >= srv.cfg.max_clients:
            refusal = CapacityError(f"the daemon serves {len(srv.connections)} clients, its limit "
                                    f"(max_clients {srv.cfg.max_clients})")
        if refusal is not None:
            log.warning("connection %d (pid %d, uid %d) refused: %s", self.cid, self.peer.pid,
                        self.peer.uid, refusal)
            # the notice first; the close only once the client has spoken (its
            # hello): closing at once can reset the socket before the client
            # reads why, and it would see a broken pipe instead of the reason
            transport.write(protocol.notice_bye(refusal))
            self.closed = self.refused = True
            asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)
            return
        srv.connections[self.cid] = self
        self.worker = asyncio.get_running_loop().create_task(self._work())

    def data_received(self, data: bytes) -> None:
        if self.closed:
            if self.refused:
                self.transport.close()
            return
        try:
            for msg in self.conn.receive(data):
                self.queue.put_nowait(msg)
        except ProtocolError as exc:
            log.warning("connection %d: %s; closing it", self.cid, exc)
            self.kick(exc)

    def connection_lost(self, exc) -> None:
        if self.cid not in self.srv.connections:
            return  # refused at connect: nothing was set up
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
            except Exception as exc:  # a bug must not take the daemon down
                log.exception("connection %d: %s failed", self.cid, msg.get("op"))
                frame = protocol.reply_error(rid, ReplayError(f"internal error: {exc}"))
            if self.transport.is_closing():
                return
            self.transport.write(frame)

    async def _dispatch(self, msg: dict) -> dict | None:
        op, srv = msg["op"], self.srv
        if op in ADMIN_OPS and not access.may_administer(srv.cfg, self.peer):
            raise PermissionDenied(f"{op} is an admin operation: only the daemon's user, root or "
                                   f"the admin_group may run it (you are uid {self.peer.uid})")
        if op == "hello":
            return self._hello(msg["pid"])
        if op == "ready":
            return await self._ready()
        if op == "create_table":
            return {"table": await srv.create_table(msg["spec"], msg["exist_ok"])}
        if op == "open_table":
            d = await srv.call(srv.engine.describe, check_table_name(msg["name"]))
            if d is None:
                raise UnknownTable(f"no table named {msg['name']!r}")
            return {"table": d}
        if op == "drop_table":
            await srv.drop_table(msg["name"])
            return None
        if op == "list_tables":
            return {"tables": await srv.call(srv.engine.describe)}
        if op in ("stats", "status"):
            return await srv.status()
        if op == "checkpoint":
            if not all(isinstance(n, str) for n in msg["tables"]):
                raise ProtocolError("checkpoint: 'tables' must be a list of names")
            return {"checkpoints": await srv.checkpoint(msg["tables"], msg["to"])}
        if op == "shutdown":
            log.info("shutdown requested by pid %d (uid %d)", self.peer.pid, self.peer.uid)
            srv.request_shutdown()
            return None
        raise ProtocolError(f"op {op!r} has no handler")

    def _hello(self, pid: int) -> dict:
        cfg, srv = self.srv.cfg, self.srv
        if not 0 < pid < 2**32:
            raise ProtocolError(f"hello: pid {pid} is not a process id")
        name = names.channel_segment(cfg.instance, srv.pid, self.cid)
        sem = names.channel_semaphore(name)
        # the client must open both: give them to its user when we can (root)
        owner = (self.peer.uid if os.geteuid() == 0 else -1, cfg.gid)
        self.channel = Channel.create(name, CHANNEL, pid, srv.pid, cfg.segment_mode, owner)
        self.sem = create_semaphore(sem, cfg.segment_mode, owner)
        return {"protocol": PROTOCOL_VERSION, "daemon_pid": srv.pid, "instance": cfg.instance,
                "channel": name, "channel_sem": sem, "doorbell": names.doorbell(cfg.instance, srv.pid),
                "max_batch": records.MAX_BATCH}

    async def _ready(self) -> None:
        # the client has both open: drop the names now, so nothing is left in
        # /dev/shm if either side dies; the objects live while mapped/open
        self.channel.seg.unlink()
        self.sem.unlink()
        cl = ClientState(self.cid, self.conn.client_pid, self.channel, self.sem)
        # attached before the await: if the connection drops meanwhile this
        # task is cancelled, and _end_lease must still detach (engine calls
        # run in order, so the detach follows the add if the add ran)
        self.attached = True
        await self.srv.call(self.srv.engine.add_client, cl)
        log.debug("client %d (pid %d) attached", self.cid, self.conn.client_pid)

    async def _end_lease(self) -> None:
        if self.attached:
            cl = await self.srv.call(self.srv.engine.detach_client, self.cid)
            if cl is not None:  # drop its views so the unmap below succeeds
                cl.detach()
        if self.channel is not None:
            self.channel.seg.unlink()  # no-op after ready
            self.channel.release()
        if self.sem is not None:
            unlink_semaphore_quiet(self.sem.name)
            self.sem.close()
        log.debug("connection %d closed", self.cid)


def _claim_socket_path(path: str) -> None:
    """Remove a stale socket file; refuse if a live daemon answers on it."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    except OSError as exc:
        raise ReplayError(f"socket path {path} is in use and not a socket we can probe: {exc}")
    finally:
        probe.close()
    raise ReplayError(f"another daemon is serving {path}")
