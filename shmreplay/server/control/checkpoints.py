"""Checkpoints asked for by an admin (``shmreplay checkpoint``) or the
daemon's timer: one at a time, each table in turn.

What a checkpoint is, and how it is written without a pause longer than
one metadata copy, is ``disk/checkpoint.py``'s: here the engine takes each
table's snapshot (``ControlServer.call``), an executor thread writes it.

Event-loop thread, owned by the ``ControlServer``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time

from ...errors import ReplayError
from ...schema import check_table_name
from ..disk import checkpoint

log = logging.getLogger("shmreplayd.control")


class Checkpoints:
    def __init__(self, srv):
        self.srv = srv  # the ControlServer: its config, loop and engine calls
        self.lock = asyncio.Lock()
        self.last_success: dict[str, float] = {}  # table -> wall time of its last checkpoint written

    async def write(self, names: list, directory: str, keep: int = 0) -> list[dict]:
        """Checkpoint tables (all if ``names`` is empty) into ``directory``,
        one at a time; inserts and samples pause only for each snapshot.
        ``keep`` > 0: only the newest that many of each table stay."""
        if not os.path.isabs(directory):
            raise ReplayError(f"checkpoint directory must be an absolute path, got {directory!r}")
        srv, cfg = self.srv, self.srv.cfg
        reports = []
        async with self.lock:
            if not names:
                names = sorted(await srv.call(srv.engine.table_names))
            for name in names:
                table = await srv.call(srv.engine.table_named, check_table_name(name))
                bufs = await srv.loop.run_in_executor(None, checkpoint.buffers, table.spec.capacity)
                snap = await srv.call(checkpoint.snapshot, table, bufs)
                try:
                    rep = await srv.loop.run_in_executor(None, functools.partial(
                        checkpoint.write, snap, directory, keep, int(cfg.checkpoint_buffer_mb * 2**20),
                        segment_mode=cfg.segment_mode, gid=cfg.gid))
                except OSError as exc:
                    raise ReplayError(f"checkpoint of table {name!r} into {directory} failed: {exc}")
                finally:
                    snap.rows.close()
                log.info("checkpoint of table %s: %d items (%d evicted during the copy), %.1f MiB "
                         "in %.2f s to %s; engine paused %.2f ms", name, rep["items"], rep["dropped"],
                         rep["bytes"] / 2**20, rep["write_s"], rep["path"], 1e3 * rep["pause_s"])
                self.last_success[name] = time.time()
                reports.append(rep)
        return reports
