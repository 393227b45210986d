"""When the syncs of durable file-backed tables run (``disk/durable.py`` says what one does).

Event-loop thread, owned by the tables' life cycle (lifecycle.py).  Syncs of one table run
one at a time, each as a task this object owns, under that table's lock:
a caller that is cancelled (a client that hung up, a stop) stops waiting,
never the sync, so no write outlives its lock, races the next sync, or
lands after its table was dropped.  Syncs come from ``shmreplay sync``, the
periodic timer (server/daemon.py), a full table that needs its retired slots
(``Table`` -> ``Durability.want`` on the engine thread -> ``soon``), the
first moments of a table, and the clean stop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ...errors import ReplayError
from ..disk import durable

log = logging.getLogger("shmreplayd.durable")


class Syncer:
    def __init__(self, srv):
        self.srv = srv  # the ControlServer: its loop, engine calls
        self.locks: dict[str, asyncio.Lock] = {}  # durable tables being served
        self.states: dict[str, durable.Durability] = {}  # their sync state (back-off)
        self.timers: dict[str, asyncio.TimerHandle] = {}  # a retry after a back-off, at most one each
        self.tasks: set[asyncio.Task] = set()

    def make_durable(self, table, recover: bool) -> None:
        """Executor, before the table is served: its metadata file with its
        space reserved (a full disk: DiskFull, the table is not served), its
        reuse barrier and sync state; an adopted table protects what its
        file on disk lists (until its first sync, which follows at once)."""
        name = table.spec.name
        path = durable.meta_file(table.map)
        seq = durable.reserve(path, table.map.layout.size, fresh=not recover)
        loop = self.srv.loop
        state = durable.Durability(path, lambda: loop.call_soon_threadsafe(self.soon, name))
        state.seq = seq
        self.states[name] = state
        table.make_durable(state, durable.listed_on_disk(table.map, path) if recover else None)

    async def serve(self, name: str) -> None:
        """The table is in the engine: from now on it is synced; the first
        sync writes its file at once (a failure is logged and counted, and
        the next sync tries again: the table is served either way)."""
        self.locks[name] = asyncio.Lock()
        try:
            await self.sync([name])
        except ReplayError as exc:
            log.error("first sync of table %s failed: %s", name, exc)

    def soon(self, name: str) -> None:
        self._start(name, forced=False)

    async def sync(self, names: list[str], forced: bool = True) -> list[dict]:
        """Sync each table now, one after the other; the reports of those
        still served.  Raises the first failure.  Not ``forced`` (the
        periodic sync): a table whose syncs back off is left to its retry."""
        reports = []
        for name in names:
            task = self._start(name, forced)
            rep = None if task is None else await asyncio.shield(task)
            if rep is not None:
                reports.append(rep)
        return reports

    def _start(self, name: str, forced: bool) -> asyncio.Task | None:
        lock = self.locks.get(name)
        if lock is None:  # not (or no longer) a durable table being served
            return None
        d = self.states.get(name)
        wait = 0.0 if forced or d is None else d.retry_at - time.monotonic()
        if wait > 0:  # backing off after a failure: one retry, when it is due
            if name not in self.timers:
                self.timers[name] = self.srv.loop.call_later(wait, self._retry, name)
            return None
        task = self.srv.loop.create_task(self._one(name, lock))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(_settled)
        return task

    def _retry(self, name: str) -> None:
        self.timers.pop(name, None)
        self._start(name, forced=False)

    async def _one(self, name: str, lock: asyncio.Lock) -> dict | None:
        async with lock:
            if self.locks.get(name) is not lock:
                return None  # dropped (maybe made again) while this waited
            srv = self.srv
            table = await srv.call(srv.engine.table_named, name)
            d = table.durable
            t0 = time.monotonic()
            try:
                copy = await srv.loop.run_in_executor(None, durable.Copy, table.map.layout.size)
                copy = await srv.call(durable.take, table, copy)
                n = await srv.loop.run_in_executor(None, durable.write, copy, table.map.rows.fd, d.path,
                                                   d.seq + 1)
            except (OSError, ReplayError) as exc:  # a full disk; a directory made unsafe since (safedir)
                wait = d.failed(str(exc))
                log.error("sync of table %s to %s failed: %s; the copy of the sync before stays, "
                          "and the next try is in %g s (doubling with each failure, up to %g s)",
                          name, d.path, exc, wait, durable.BACKOFF_MAX_S)
                raise ReplayError(f"sync of table {name!r} to {d.path} failed: {exc}; the copy of "
                                  "the sync before stays") from None
            finally:
                d.wanted = False  # whatever happened, a full table may ask again
            if d.error is not None:
                log.info("sync of table %s to %s succeeds again", name, d.path)
            d.succeeded()
            d.seq += 1
            dt = time.monotonic() - t0
            freed = await srv.call(durable.landed, table, copy, dt)
        return {"table": name, "items": copy.items, "bytes": n, "seconds": dt, "freed": freed,
                "path": d.path}

    async def drop(self, name: str, final: bool):
        """The table's lock, for the caller to hold while it drops the table
        (None: not durable), and whether the last sync ``final`` (a clean
        stop) asked for landed (None: not asked)."""
        lock = self.locks.get(name)
        landed = None
        if lock is not None and final:
            try:
                await self.sync([name])
                landed = True
            except ReplayError:
                landed = False
        return lock, landed

    def forget(self, name: str) -> None:
        self.locks.pop(name, None)
        self.states.pop(name, None)
        timer = self.timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    async def wait(self) -> None:
        """Until every sync started has ended (the clean stop)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


def _settled(task: asyncio.Task) -> None:
    # its failure was logged where it happened; a caller that stopped
    # waiting must not leave it "never retrieved"
    if not task.cancelled():
        task.exception()
