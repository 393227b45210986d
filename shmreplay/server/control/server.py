"""The daemon's control plane: a Unix-socket server on asyncio/uvloop.

Runs on the daemon's event-loop thread.  The gate (gate.py) accepts each
connection and decides who comes in; one ``ControlConnection`` per
admitted client (connection.py) answers its requests in order; the table
book (quotas.py) says what another user may still create; anything that
touches tables runs on the engine thread, through the
engine's named entry points (``ControlServer.call``); slow work (creating
a multi-GiB segment, writing a checkpoint) runs in the default executor so
the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import stat
import time

from ...errors import CapacityError, DaemonUnavailable, ForeignObject, ReplayError, TableExists, UnknownTable
from ...schema import check_table_name, spec_from_wire
from ...wire import names
from ...version import __version__
from ...wire.control import PROTOCOL_VERSION
from ...wire.layout import TableMap
from ...wire.segment import restore_size
from ...wire.rowfile import resident_bytes, unlink_file_quiet
from ..disk import durable, safedir, storage
from ..engine.engine import Engine
from ..tables import tablestats
from ..tables.table import Table
from . import recovery, seen
from .aside import SetAside
from .checkpoints import Checkpoints
from .access import may_administer, writer_of
from .config import DaemonConfig
from .connection import ControlConnection
from .descriptors import PER_TABLE
from .gate import Gate
from .memory import check_memory
from .monitor import Monitor, daemon_memory
from .quotas import TableBook
from .syncs import Syncer

log = logging.getLogger("shmreplayd.control")

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
        self.gate = Gate(self)  # the socket's front door: who comes in (gate.py)
        self.book = TableBook(cfg)  # who created each table: per-user limits (quotas.py)
        self.path: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.detaching: set[asyncio.Task] = set()
        self.checkpoints = Checkpoints(self)  # one at a time (checkpoints.py)
        self.adopted: set[str] = set()  # tables taken over from a dead daemon
        self.aside = SetAside()  # tables found, or declared, that cannot be served (aside.py)
        self.syncs = Syncer(self)  # durable file-backed tables' syncs (syncs.py)
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
        bye = DaemonUnavailable("daemon is shutting down")
        for conn in list(self.connections.values()):
            conn.kick(bye)
        while self.detaching:
            await asyncio.gather(*self.detaching, return_exceptions=True)
        await self.syncs.wait()
        if self.path:
            unlink_file_quiet(self.path)

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
    async def create_table(self, wire: dict, exist_ok: bool, peer=None) -> dict:
        """``peer`` (an access.Peer) asks; None: the daemon itself."""
        asked = spec_from_wire(wire)
        self.aside.refuse(asked.name)
        existing = await self.call(self.engine.describe, asked.name)
        have = None if existing is None else spec_from_wire(existing["spec"])
        spec = writer_of(self.cfg.place(asked), peer, self.cfg, have)  # the creator: the kernel's word
        if have is not None:
            if asked.storage_dir is None:  # not asked for a place: wherever it lives now
                have = dataclasses.replace(have, storage_dir=spec.storage_dir)
            if exist_ok and have == spec:
                await self._rows_whole(spec.name)  # a client attaches to it next
                return existing
            raise TableExists(f"table {spec.name!r} exists already"
                              + (" with a different schema" if exist_ok else ""))
        if spec.name in self.creating:
            raise TableExists(f"table {spec.name!r} is being created by another client")
        self.creating.add(spec.name)  # before the next await: a second create must see it
        try:
            count = len(await self.call(self.engine.table_names))
            if count + len(self.creating) - 1 >= self.cfg.max_tables:
                raise CapacityError(f"the daemon serves {count} tables, its limit (max_tables "
                                    f"{self.cfg.max_tables}); drop one or raise the limit")
            self._claim(spec, peer)
            try:
                return await self.add_table(spec)
            except BaseException:
                self.book.release(spec.name)
                raise
        finally:
            self.creating.discard(spec.name)

    async def open_table(self, name: str) -> dict:
        """A client attaches to a table: its description, once its rows
        object has the size its layout says (a client with write access may
        have changed it; ``segment.restore_size``)."""
        d = await self.call(self.engine.describe, name)
        if d is None:
            self.aside.refuse(name)
            raise UnknownTable(f"no table named {name!r}")
        await self._rows_whole(name)
        return d

    async def _rows_whole(self, name: str) -> None:
        """Give a table's rows object the size its layout says, if a client
        changed it: a look (``fstat``) here, the repair off the event loop
        (it may reserve gigabytes again), on a duplicate of the daemon's
        descriptor, which a drop meanwhile does not close."""
        table = await self.call(self.engine.table_named, name)
        rows, size = table.map.rows, table.map.layout.rows_size
        if rows.fd is None or os.fstat(rows.fd).st_size == size:
            return
        fd = os.dup(rows.fd)
        try:
            await self.loop.run_in_executor(None, restore_size, fd, rows.name, size)
        finally:
            os.close(fd)

    def _claim(self, spec, peer) -> None:
        """Book the table for its creator (quotas.py); one of anyone but
        root, the daemon's user and the admin group may not eat into the
        descriptor reserve either (descriptors.py)."""
        if peer is not None and not may_administer(self.cfg, peer):
            # the creates in flight (this one among them) will hold theirs too
            busy = self.gate.in_use() + (len(self.creating) - 1) * PER_TABLE
            why = self.gate.fds.refusal(PER_TABLE, busy, f"table {spec.name!r}")
            if why is not None:
                raise why
        self.book.claim(spec, os.geteuid() if peer is None else peer.uid,
                        admin=peer is not None and may_administer(self.cfg, peer))

    async def add_table(self, spec, tmap: TableMap | None = None, recover: bool = False) -> dict:
        """Serve a table: a new segment, or ``tmap`` (adopted or restored,
        ``recover``: rebuild the table from what it holds)."""
        name = names.table_segment(self.cfg.instance, spec.name) if tmap is None else tmap.name
        t0 = time.monotonic()
        tid = self.next_table_id  # taken now: two creates may overlap at the awaits below
        self.next_table_id += 1
        fresh = tmap is None
        if fresh:
            check_memory(spec)
            if spec.file_backed:
                await self.loop.run_in_executor(None, storage.prepare_dir, spec.storage_dir, self.cfg.gid)
            tmap = await self.loop.run_in_executor(None, TableMap.create, name, spec, self.cfg.gid)
        seed = None if self.cfg.seed is None else self.cfg.seed + tid
        # built off the event loop: a table of millions of slots takes a while,
        # and the loop must go on answering everyone else meanwhile
        if recover:
            build = functools.partial(recovery.rebuild, tid, spec, tmap, seed, self.cfg.slot_limits())
        else:
            build = functools.partial(Table, tid, spec, tmap, seed, limits=self.cfg.slot_limits())
        try:
            table = await self.loop.run_in_executor(None, build)
            if spec.file_backed and self.cfg.durable_file_tables:
                await self.loop.run_in_executor(None, self.syncs.make_durable, table, recover)
            elif spec.file_backed:  # a file from when it was on: kept in step no more
                await self.loop.run_in_executor(None, durable.remove_stale, tmap)
        except BaseException:
            if fresh:  # an adopted or restored segment is the caller's to keep or drop
                tmap.unlink()
            tmap.release()
            raise
        tmap.open_to_clients(self.cfg.segment_mode, self.cfg.gid)
        await self.call(self.engine.add_table, table)
        self.book.keep(spec)  # the config's, adopted or restored: the daemon's own user's
        self.gate.recount()   # its segments' descriptors
        if table.durable is not None:  # a file on disk from the start
            await self.syncs.serve(spec.name)
        log.info("table %s: %d x %d bytes, rows in %s (%.1f MiB), meta in %s; ready in %.2f s", spec.name,
                 spec.capacity, spec.item_bytes, tmap.rows.name, tmap.layout.rows_size / 2**20, name,
                 time.monotonic() - t0)
        return tablestats.describe(table)

    async def sync(self, names: list) -> list[dict]:
        """``shmreplay sync``: durable tables (all if ``names`` is empty) to
        disk now (syncs.py); a table that is not durable is an error."""
        names = names or sorted(self.syncs.locks)
        for name in names:
            if check_table_name(name) not in self.syncs.locks:
                table = await self.call(self.engine.table_named, name)  # unknown: UnknownTable
                why = ("its rows are on disk but durable_file_tables is off" if table.spec.file_backed
                       else "it lives in /dev/shm")
                raise ReplayError(f"table {name!r} is not a durable file-backed table ({why}); "
                                  "there is nothing to sync")
        return await self.syncs.sync(names)

    async def drop_table(self, name: str, unlink: bool = True, keep_disk: bool = False) -> None:
        """Stop serving a table; ``unlink``: remove it.  ``keep_disk`` (a
        clean stop): a durable table is synced a last time and its files
        stay for the next start; only its meta segment goes."""
        check_table_name(name)
        if name in self.aside:  # an admin's way out for a table set aside: its own files go
            self.aside.drop(name)
            return
        lock, landed = await self.syncs.drop(name, final=keep_disk)
        async with lock or contextlib.nullcontext():
            table = await self.call(self.engine.drop_table, name)
            self.syncs.forget(name)
        if unlink and landed is False:  # the file on disk is older than /dev/shm: keep both
            unlink = False
            log.error("table %s: its last sync failed; left in /dev/shm too, for the next start", name)
        if unlink and table.durable is not None and keep_disk:
            table.map.meta.unlink()
            what = f"kept on disk for the next start ({table.durable.items} items)"
        elif unlink:
            if table.durable is not None:  # never through a link, only the daemon's own files
                await self.loop.run_in_executor(None, durable.remove_files, table.durable.path)
            table.map.unlink()
            what = "dropped"
        else:
            what = "left in /dev/shm for the next daemon"
        table.map.release()
        self.book.release(name)
        self.gate.recount()
        log.info("table %s %s", name, what)

    async def drop_all_tables(self, unlink: bool = True, keep_adopted: bool = False) -> None:
        """The clean stop's step 3: durable tables are synced and stay on disk."""
        for name in await self.call(self.engine.table_names):
            kept = keep_adopted and name in self.adopted  # touched in no way
            await self.drop_table(name, unlink and not kept, keep_disk=not kept)
        await self.syncs.wait()  # asked for meanwhile

    async def checkpoint(self, names: list, directory: str, keep: int = 0) -> list[dict]:
        """Checkpoint tables (all if ``names`` is empty) into ``directory``
        (``checkpoints.py``)."""
        return await self.checkpoints.write(names, directory, keep)

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
            conn = self.connections.get(c["client"])
            c["uid"] = conn.peer.uid if conn is not None else None
        st = {"daemon_pid": self.pid, "protocol": PROTOCOL_VERSION, "instance": self.cfg.instance,
              "version": __version__, "memory": daemon_memory(), "metrics": self.metrics_url,
              "socket": self.path, "uptime_s": now - self.started,
              "connections": len(self.connections), **snap, "set_aside": self.aside.report(),
              "descriptors": self.gate.status(), "creators": self.book.status()}
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
