"""The tables' life cycle as the control plane sees it: create, open, add
(a new segment, or an adopted or restored one), sync, drop.

``TableLifecycle`` owns what the daemon knows about its tables beside the
engine: the table ids it hands out, the names being created (so two
creates of one name cannot race), the tables adopted from a dead daemon,
the tables set aside (setaside.py), who created each (the table book,
quotas.py) and the durable tables' syncs (syncs.py).  The tables
themselves live in the engine: it reaches them only through the engine's
entry points (``ControlServer.call``); slow work (a multi-GiB segment, a
table of millions of slots, a directory to prepare) runs in the loop's
executor so the loop keeps serving.

Who calls: the event-loop thread only: a connection's ops (ops.py),
startup (recovery.py) and the clean stop (server/daemon.py).  Calls may
overlap at their awaits (two clients creating at once); the state above
is what keeps them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time

from ...errors import CapacityError, ReplayError, TableExists, UnknownTable
from ...schema import check_table_name, spec_from_wire
from ...wire import names
from ...wire.layout import TableMap
from ...wire.segment import restore_size
from ..disk import durable, storage
from ..tables import tablestats
from ..tables.table import Table
from . import recovery
from .access import may_administer, writer_of
from .descriptors import PER_TABLE
from .memory import check_memory
from .quotas import TableBook
from .setaside import SetAside
from .syncs import Syncer

log = logging.getLogger("shmreplayd.control")

# a create with exist_ok waits this long for another client's create of the
# same name to end (then answers as for a table that exists): under the
# client's default request timeout (30 s), so the client hears the answer
CREATE_WAIT_S = 20.0


class TableLifecycle:
    def __init__(self, srv):
        self.srv = srv  # the ControlServer: its config, loop, engine calls and gate
        self.cfg = srv.cfg
        self.next_table_id = 1
        self.creating: dict[str, asyncio.Event] = {}  # set when that create ends
        self.adopted: set[str] = set()  # tables taken over from a dead daemon
        self.set_aside = SetAside()  # tables found, or declared, that cannot be served (setaside.py)
        self.book = TableBook(srv.cfg)  # who created each table: per-user limits (quotas.py)
        self.syncs = Syncer(srv)  # durable file-backed tables' syncs (syncs.py)

    async def create(self, wire: dict, exist_ok: bool, peer=None) -> dict:
        """``peer`` (an access.Peer) asks; None: the daemon itself.  With
        ``exist_ok``, a create of the same name under way is waited for
        (CREATE_WAIT_S), so processes that all make the table they share
        at start (TorchRL's collector workers) each get it."""
        asked = spec_from_wire(wire, asked=True)
        deadline = time.monotonic() + CREATE_WAIT_S
        while True:
            ended = self.creating.get(asked.name)
            if ended is None or not exist_ok:
                made = await self._create(asked, exist_ok, peer)
                if made is not None:
                    return made
                continue  # another create of the name began during our awaits: wait for it
            try:
                await asyncio.wait_for(ended.wait(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise TableExists(f"table {asked.name!r} is still being created by another client "
                                  f"after {CREATE_WAIT_S:.0f} s; try again") from None

    async def _create(self, asked, exist_ok: bool, peer) -> dict | None:
        """Make the table, or return the one that exists (exist_ok, the
        same definition); None when another create of the name is under
        way (exist_ok)."""
        srv = self.srv
        self.set_aside.refuse(asked.name)
        existing = await srv.call(srv.engine.describe, asked.name)
        have = None if existing is None else spec_from_wire(existing["spec"])
        spec = writer_of(self.cfg.place(asked), peer, self.cfg, have)  # the creator: the kernel's word
        if have is not None:
            if asked.storage_dir is None:  # not asked for a place: wherever it lives now
                have = dataclasses.replace(have, storage_dir=spec.storage_dir)
            # how its rows lie is not what a table is: it keeps its own
            have = dataclasses.replace(have, row_layout=spec.row_layout)
            if exist_ok and have == spec:
                await self._rows_whole(spec.name)  # a client attaches to it next
                return existing
            raise TableExists(f"table {spec.name!r} exists already"
                              + (" with a different schema" if exist_ok else ""))
        if spec.name in self.creating:
            if exist_ok:
                return None  # create() waits for that one
            raise TableExists(f"table {spec.name!r} is being created by another client")
        self.creating[spec.name] = asyncio.Event()  # before the next await: a second create must see it
        try:
            count = len(await srv.call(srv.engine.table_names))
            if count + len(self.creating) - 1 >= self.cfg.max_tables:
                raise CapacityError(f"the daemon serves {count} tables, its limit (max_tables "
                                    f"{self.cfg.max_tables}); drop one or raise the limit")
            self._claim(spec, peer)
            try:
                return await self.add(spec)
            except BaseException:
                self.book.release(spec.name)
                raise
        finally:
            self.creating.pop(spec.name).set()

    async def open(self, name: str) -> dict:
        """A client attaches to a table: its description, once its rows
        object has the size its layout says (a client with write access may
        have changed it; ``segment.restore_size``)."""
        d = await self.srv.call(self.srv.engine.describe, name)
        if d is None:
            self.set_aside.refuse(name)
            raise UnknownTable(f"no table named {name!r}")
        await self._rows_whole(name)
        return d

    async def _rows_whole(self, name: str) -> None:
        """Give a table's rows object the size its layout says, if a client
        changed it: a look (``fstat``) here, the repair off the event loop
        (it may reserve gigabytes again), on a duplicate of the daemon's
        descriptor, which a drop meanwhile does not close."""
        table = await self.srv.call(self.srv.engine.table_named, name)
        rows, size = table.map.rows, table.map.layout.rows_size
        if rows.fd is None or os.fstat(rows.fd).st_size == size:
            return
        fd = os.dup(rows.fd)
        try:
            await self.srv.loop.run_in_executor(None, restore_size, fd, rows.name, size)
        finally:
            os.close(fd)

    def _claim(self, spec, peer) -> None:
        """Book the table for its creator (quotas.py); one of anyone but
        root, the daemon's user and the admin group may not eat into the
        descriptor reserve either (descriptors.py)."""
        if peer is not None and not may_administer(self.cfg, peer):
            # the creates in flight (this one among them) will hold theirs too
            gate = self.srv.gate
            busy = gate.in_use() + (len(self.creating) - 1) * PER_TABLE
            why = gate.fds.refusal(PER_TABLE, busy, f"table {spec.name!r}")
            if why is not None:
                raise why
        self.book.claim(spec, os.geteuid() if peer is None else peer.uid,
                        admin=peer is not None and may_administer(self.cfg, peer))

    async def add(self, spec, tmap: TableMap | None = None, recover: bool = False) -> dict:
        """Serve a table: a new segment, or ``tmap`` (adopted or restored,
        ``recover``: rebuild the table from what it holds)."""
        cfg, loop = self.cfg, self.srv.loop
        name = names.table_segment(cfg.instance, spec.name) if tmap is None else tmap.name
        t0 = time.monotonic()
        tid = self.next_table_id  # taken now: two creates may overlap at the awaits below
        self.next_table_id += 1
        fresh = tmap is None
        if fresh:
            check_memory(spec)
            if spec.file_backed:
                await loop.run_in_executor(None, storage.prepare_dir, spec.storage_dir, cfg.gid)
            tmap = await loop.run_in_executor(None, TableMap.create, name, spec, cfg.gid)
        seed = None if cfg.seed is None else cfg.seed + tid
        # built off the event loop: a table of millions of slots takes a while,
        # and the loop must go on answering everyone else meanwhile
        if recover:
            build = functools.partial(recovery.rebuild, tid, spec, tmap, seed, cfg.slot_limits())
        else:
            build = functools.partial(Table, tid, spec, tmap, seed, limits=cfg.slot_limits())
        try:
            table = await loop.run_in_executor(None, build)
            if spec.file_backed and cfg.durable_file_tables:
                await loop.run_in_executor(None, self.syncs.make_durable, table, recover)
            elif spec.file_backed:  # a file from when it was on: kept in step no more
                await loop.run_in_executor(None, durable.remove_stale, tmap)
        except BaseException:
            if fresh:  # an adopted or restored segment is the caller's to keep or drop
                tmap.unlink()
            tmap.release()
            raise
        tmap.open_to_clients(cfg.segment_mode, cfg.gid)
        await self.srv.call(self.srv.engine.add_table, table)
        self.book.keep(spec)  # the config's, adopted or restored: the daemon's own user's
        self.srv.gate.recount()   # its segments' descriptors
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
                table = await self.srv.call(self.srv.engine.table_named, name)  # unknown: UnknownTable
                why = ("its rows are on disk but durable_file_tables is off" if table.spec.file_backed
                       else "it lives in /dev/shm")
                raise ReplayError(f"table {name!r} is not a durable file-backed table ({why}); "
                                  "there is nothing to sync")
        return await self.syncs.sync(names)

    async def drop(self, name: str, unlink: bool = True, keep_disk: bool = False) -> None:
        """Stop serving a table; ``unlink``: remove it.  ``keep_disk`` (a
        clean stop): a durable table is synced a last time and its files
        stay for the next start; only its meta segment goes."""
        check_table_name(name)
        if name in self.set_aside:  # an admin's way out for a table set aside: its own files go
            self.set_aside.drop(name)
            return
        lock, landed = await self.syncs.drop(name, final=keep_disk)
        async with lock or contextlib.nullcontext():
            table = await self.srv.call(self.srv.engine.drop_table, name)
            self.syncs.forget(name)
        if unlink and landed is False:  # the file on disk is older than /dev/shm: keep both
            unlink = False
            log.error("table %s: its last sync failed; left in /dev/shm too, for the next start", name)
        if unlink and table.durable is not None and keep_disk:
            table.map.meta.unlink()
            what = f"kept on disk for the next start ({table.durable.items} items)"
        elif unlink:
            if table.durable is not None:  # never through a link, only the daemon's own files
                await self.srv.loop.run_in_executor(None, durable.remove_files, table.durable.path)
            table.map.unlink()
            what = "dropped"
        else:
            what = "left in /dev/shm for the next daemon"
        table.map.release()
        self.book.release(name)
        self.srv.gate.recount()
        log.info("table %s %s", name, what)

    async def drop_all(self, unlink: bool = True, keep_adopted: bool = False) -> None:
        """The clean stop's step 3: durable tables are synced and stay on disk."""
        for name in await self.srv.call(self.srv.engine.table_names):
            kept = keep_adopted and name in self.adopted  # touched in no way
            await self.drop(name, unlink and not kept, keep_disk=not kept)
        await self.syncs.wait()  # asked for meanwhile
