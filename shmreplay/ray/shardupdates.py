"""A learner's priority updates to a sharded table's shards: each key's new
priority goes to the shard it came from (a batch's ``shards``).

The learner's own shard is updated through a client of its own (a
``ShardAgent`` in this process, apart from the one that draws): an update
never waits for a draw parked in that shard's limiter.  A remote shard's
updates go to its agent (``ShardBook.agents``) and are not waited for: what
one raised (bad priorities) comes up at the next update or ``settle``; a
shard out of service, or lost, drops them, and they are counted
(``lost``).  ``settle`` returns once every update sent so far is applied
by its shard's daemon.

Who calls it: the ``ShardedTable`` that owns it, from the learner's thread
(while its prefetch thread may draw through the same ``ShardBook``).
"""

from __future__ import annotations

import numpy as np
import ray

from ..errors import DaemonUnavailable, PriorityError, ReplayTimeout
from .shardagent import ShardAgent


class ShardUpdates:
    def __init__(self, book):
        """``book``: the table's ``ShardBook`` (its shards, agents, lost
        shards, and the answers of calls to them)."""
        self.book = book
        local = book.local
        self.local = (ShardAgent(book.shards[local].socket, book.name, book.shard_timeout)
                      if local is not None else None)
        self.pending: list = []  # (shard, keys, ref): sent to remote agents, not yet seen through
        self.unflushed: set = set()  # shards updated since the last settle
        self.lost = 0  # updates a shard out of service dropped

    def update(self, keys, priorities, shards) -> None:
        """New priorities to the shards the keys came from (see the module
        docstring)."""
        book = self.book
        keys = np.ascontiguousarray(keys, np.uint64)
        prios = np.ascontiguousarray(priorities, np.float64)
        where = np.ascontiguousarray(shards, np.int64)
        if not keys.shape == prios.shape == where.shape or keys.ndim != 1:
            raise PriorityError(f"keys, priorities and shards must be 1-d and as long: got {keys.shape}, "
                                f"{prios.shape}, {where.shape}")
        if not np.all(np.isfinite(prios)) or np.any(prios < 0):
            raise PriorityError("priorities must be finite and >= 0 (no NaN, no inf)")
        if where.size and (where.min() < 0 or where.max() >= book.count):
            raise PriorityError(f"shards must be 0..{book.count - 1} (a batch's ``shards``), got {where.max()}")
        self._collect(0)
        for i in np.unique(where):
            i = int(i)
            sel = where == i
            n = int(np.count_nonzero(sel))
            if i in book.lost:
                self.lost += n
                continue
            if i == book.local:
                try:
                    self.local.update(keys[sel], prios[sel])
                except DaemonUnavailable:
                    self.lost += n
            else:
                self.pending.append((i, n, book.agents[i].update.remote(keys[sel], prios[sel])))
            self.unflushed.add(i)

    def settle(self, timeout: float | None = None) -> None:
        """Return once every update sent so far is applied by its shard's
        daemon (``ShardedTable.flush``): each agent's calls seen through,
        then a flush of each shard updated since the last settle (an
        agent's calls run in order: its flush runs after its updates)."""
        book = self.book
        timeout = book.call_s if timeout is None else timeout
        shards, self.unflushed = sorted(self.unflushed - set(book.lost)), set()
        refs = {i: book.agents[i].flush.remote() for i in shards if i != book.local}
        self._collect(timeout)
        if self.pending:
            raise ReplayTimeout(f"priority updates to shards {sorted({i for i, _, _ in self.pending})} were not "
                                f"applied within {timeout} s; flush() again to wait longer")
        if book.local in shards:
            try:
                self.local.flush()
            except DaemonUnavailable:
                pass  # its updates are lost with the daemon, as a local table's
        for i, ref in refs.items():
            r = book.get(i, ref, timeout)
            if isinstance(r, BaseException) and not isinstance(r, DaemonUnavailable):
                raise r

    def _collect(self, timeout: float) -> None:
        """The answers of the updates sent to remote agents that came within
        ``timeout`` each; raises what one raised."""
        keep = []
        for k, (i, n, ref) in enumerate(self.pending):
            ready, _ = ray.wait([ref], timeout=timeout)
            if not ready:
                keep.append((i, n, ref))
                continue
            r = self.book.get(i, ref, 0)
            if isinstance(r, DaemonUnavailable):
                self.lost += n
            elif isinstance(r, BaseException):
                self.pending = keep + self.pending[k + 1:]  # those after it are still waited for
                raise r
        self.pending = keep

    def close(self) -> None:
        """Close the local shard's update client (the table's close)."""
        if self.local is not None:
            self.local.close()
