"""The daemon's control plane: a Unix-socket server on asyncio/uvloop.

One ``ControlConnection`` per client wraps ``protocol.ServerConnection``
(the sans-IO rules) around a transport.  Requests of one connection are
answered in order by one task; anything that touches tables runs on the
engine thread through ``Engine.submit``; slow work (creating a multi-GiB
segment) runs in the default executor so the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import posix_ipc

from . import commands, protocol
from .channel import Channel, ChannelLayout
from .config import DaemonConfig
from .engine import ClientState, Engine
from .errors import DaemonUnavailable, ProtocolError, ReplayError, TableExists, UnknownTable
from .layout import TableMap
from .protocol import PROTOCOL_VERSION
from .schema import check_table_name, spec_from_wire
from .segment import unlink_semaphore_quiet
from .table import Table

log = logging.getLogger("shmreplayd.control")

# a channel holds the largest batch: SAMPLE replies need 24 bytes per item,
# UPDATE requests 16; 256 records a ring lets a client stream commands
CHANNEL = ChannelLayout(req_slots=256, resp_slots=256,
                        req_payload=2 * 16 * commands.MAX_BATCH,
                        resp_payload=2 * 24 * commands.MAX_BATCH)


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

    async def start(self, path: str) -> None:
        self.loop = asyncio.get_running_loop()
        _claim_socket_path(path)
        self.server = await self.loop.create_unix_server(lambda: ControlConnection(self), path=path)
        os.chmod(path, self.cfg.segment_mode)
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
        existing = await self.call(self.engine.find_table, spec.name)
        if existing is not None:
            if exist_ok and spec_from_wire(existing["spec"]) == spec:
                return existing
            raise TableExists(f"table {spec.name!r} exists already"
                              + (" with a different schema" if exist_ok else ""))
        if spec.name in self.creating:
            raise TableExists(f"table {spec.name!r} is being created by another client")
        self.creating.add(spec.name)
        try:
            return await self.add_table(spec)
        finally:
            self.creating.discard(spec.name)

    async def add_table(self, spec) -> dict:
        name = self.cfg.table_segment(spec.name)
        t0 = time.monotonic()
        tmap = await self.loop.run_in_executor(None, TableMap.create, name, spec, self.cfg.segment_mode)
        seed = None if self.cfg.seed is None else self.cfg.seed + self.next_table_id
        table = Table(self.next_table_id, spec, tmap, seed)
        self.next_table_id += 1
        await self.call(self.engine.add_table, table)
        log.info("table %s: %d x %d bytes in %s (%.1f MiB, reserved in %.2f s)", spec.name,
                 spec.capacity, spec.item_bytes, name, tmap.layout.size / 2**20, time.monotonic() - t0)
        return table.describe()

    async def drop_table(self, name: str) -> None:
        check_table_name(name)
        table = await self.call(self.engine.drop_table, name)
        table.map.seg.unlink()
        table.map.release()
        log.info("table %s dropped", name)

    async def drop_all_tables(self) -> None:
        for name in list(await self.call(lambda: list(self.engine.by_name))):
            await self.drop_table(name)

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
        self.attached = False
        self.closed = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.srv.connections[self.cid] = self
        self.worker = asyncio.get_running_loop().create_task(self._work())

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
        if op == "hello":
            return self._hello(msg["pid"])
        if op == "ready":
            return await self._ready()
        if op == "create_table":
            return {"table": await srv.create_table(msg["spec"], msg["exist_ok"])}
        if op == "open_table":
            d = await srv.call(srv.engine.find_table, check_table_name(msg["name"]))
            if d is None:
                raise UnknownTable(f"no table named {msg['name']!r}")
            return {"table": d}
        if op == "drop_table":
            await srv.drop_table(msg["name"])
            return None
        if op == "list_tables":
            return {"tables": await srv.call(lambda: [t.describe() for t in srv.engine.tables.values()])}
        if op in ("stats", "status"):
            return await srv.status()
        raise ProtocolError(f"op {op!r} has no handler")

    def _hello(self, pid: int) -> dict:
        cfg, srv = self.srv.cfg, self.srv
        if not 0 < pid < 2**32:
            raise ProtocolError(f"hello: pid {pid} is not a process id")
        name = cfg.channel_segment(srv.pid, self.cid)
        self.channel = Channel.create(name, CHANNEL, pid, srv.pid, cfg.segment_mode)
        self.sem = posix_ipc.Semaphore(name + ".s", posix_ipc.O_CREX, cfg.segment_mode, 0)
        return {"protocol": PROTOCOL_VERSION, "daemon_pid": srv.pid, "instance": cfg.instance,
                "channel": name, "channel_sem": name + ".s", "doorbell": cfg.doorbell(srv.pid),
                "max_batch": commands.MAX_BATCH}

    async def _ready(self) -> None:
        # the client has both open: drop the names now, so nothing is left in
        # /dev/shm if either side dies; the objects live while mapped/open
        self.channel.seg.unlink()
        self.sem.unlink()
        cl = ClientState(self.cid, self.conn.client_pid, self.channel, self.sem)
        await self.srv.call(self.srv.engine.add_client, cl)
        self.attached = True
        log.debug("client %d (pid %d) attached", self.cid, self.conn.client_pid)

    async def _end_lease(self) -> None:
        if self.attached:
            cl = await self.srv.call(self.srv.engine.detach_client, self.cid)
            if cl is not None:  # drop its views so the unmap below succeeds
                cl.channel = cl.req = cl.resp = None
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
