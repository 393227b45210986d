"""The daemon's control plane: a Unix-socket server on asyncio/uvloop.

``ControlServer`` puts the parts together and owns what is the daemon's as
a whole: its socket (where it listens, made safe by ``claim_socket_path``),
its loop, its identity (pid, start time, metrics address) and ``status``.
The parts, each owning its own state: the gate (gate.py) accepts each
connection and decides who comes in; the open connections (connections.py)
are counted and kicked; one ``ControlConnection`` per admitted client
(connection.py) answers its requests in order; the tables' life cycle
(lifecycle.py) creates, adds and drops tables; checkpoints (checkpoints.py)
and the monitor (monitor.py) read the tables.  Anything that touches tables
runs on the engine thread, through the engine's named entry points
(``ControlServer.call``); slow work (creating a multi-GiB segment, writing
a checkpoint) runs in the default executor so the loop keeps serving.

Runs on the daemon's event-loop thread; ``on_client_error`` is the one
method the engine thread calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import time

from ...errors import DaemonUnavailable, ForeignObject, ReplayError
from ...version import __version__
from ...wire.control import PROTOCOL_VERSION
from ...wire.rowfile import resident_bytes, unlink_file_quiet
from ..disk import safedir
from ..engine.engine import Engine
from . import seen
from .access import may_administer
from .checkpoints import Checkpoints
from .config import DaemonConfig
from .connections import Connections
from .gate import Gate
from .lifecycle import TableLifecycle
from .monitor import Monitor, daemon_memory

log = logging.getLogger("shmreplayd.control")


class ControlServer:
    def __init__(self, cfg: DaemonConfig, engine: Engine):
        self.cfg = cfg
        self.engine = engine
        self.pid = os.getpid()
        self.started = time.time()
        self.path: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections = Connections()  # open, counted, kicked (connections.py)
        self.gate = Gate(self)  # the socket's front door: who comes in (gate.py)
        self.tables = TableLifecycle(self)  # create, add, drop; set aside; syncs (lifecycle.py)
        self.checkpoints = Checkpoints(self)  # one at a time (checkpoints.py)
        self.monitor = Monitor(self.call, engine.snapshot)  # rates, memory, metrics (monitor.py)
        self.metrics_url: str | None = None  # set by the daemon when it serves metrics
        self.request_shutdown = lambda: None  # set by the Daemon

    async def start(self, path: str) -> None:
        self.loop = asyncio.get_running_loop()
        claim_socket_path(path)
        self.gate.listen(path)
        os.chmod(path, self.cfg.segment_mode)
        os.chown(path, -1, self.cfg.gid)
        self.path = path

    async def close(self) -> None:
        """Stop accepting, tell every client, end every lease."""
        await self.gate.close()
        await self.connections.close(DaemonUnavailable("daemon is shutting down"))
        await self.tables.syncs.wait()
        if self.path:
            unlink_file_quiet(self.path)

    # called from the engine thread
    def on_client_error(self, cid: int, exc: BaseException) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.connections.kick, cid, exc)

    async def call(self, fn, *args):
        return await asyncio.wrap_future(self.engine.submit(fn, *args))

    async def status(self, peer=None) -> dict:
        """The daemon's state; as ``peer`` may see it (``seen.py``: other
        users' clients as counts unless it may administer)."""
        snap = await self.call(self.engine.snapshot)
        for name, st in snap.get("tables", {}).items():
            if st.get("file_backed"):  # how much of it the page cache holds (mincore: off the engine)
                try:
                    table = await self.call(self.engine.table_named, name)
                except ReplayError:
                    continue
                st["resident_bytes"] = await self.loop.run_in_executor(None, resident_bytes, table.map.rows)
        now = time.time()
        for name, st in snap.get("tables", {}).items():
            st.update(self.monitor.rates.get(name, {}))  # inserts/samples/batches per s, last interval
            at = self.checkpoints.last_success.get(name)
            st["last_checkpoint_age_s"] = None if at is None else now - at
        for c in snap.get("client_list", []):  # the kernel's word on who they are
            c["uid"] = self.connections.uid_of(c["client"])
        st = {"daemon_pid": self.pid, "protocol": PROTOCOL_VERSION, "instance": self.cfg.instance,
              "version": __version__, "memory": daemon_memory(), "cpu": self.monitor.cpu(), "metrics": self.metrics_url,
              "socket": self.path, "uptime_s": now - self.started,
              "connections": len(self.connections), **snap, "set_aside": self.tables.set_aside.report(),
              "descriptors": self.gate.status(), "creators": self.tables.book.status()}
        return st if peer is None or may_administer(self.cfg, peer) else seen.for_user(st, peer.uid)


def claim_socket_path(path: str) -> None:
    """Check the socket's directory is one only this user (or root) can
    write, and every directory above it (``safedir.secure_dir``; created
    0700 if missing), then remove a
    stale socket; refuse if a live daemon answers on it, or if the name is
    not a socket."""
    safedir.secure_dir(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ForeignObject(f"socket path {path} exists and is not a socket; not touching it")
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
