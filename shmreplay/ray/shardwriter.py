"""A writer for a sharded table: each chunk of rows to one shard.

The rule (decided at the writer's first row, where it then runs):

* **On a shard's node**, every row goes to that shard, through shared
  memory, as any local writer's (``Client`` table inserts: the table's
  limits hold the writer back; ``flush`` vouches for every row before it).
  Nothing crosses the network.
* **Elsewhere**, rows go in chunks of ``chunk`` through the shard hosts'
  ingests (``RemoteWriter``: back-pressure of ``in_flight`` calls,
  at-least-once delivery, confirmation by ``flush``), each chunk to the
  next shard in turn, from a shard drawn at random per writer: round
  robin, so N writers spread their rows evenly and no shard gets a run
  of every writer's first chunk.  A shard whose ingest cannot be reached
  for good (its node lost: ``ChunkRefused`` after ``RemoteWriter``'s
  retries, or its host gone when the writer starts) leaves the rotation;
  the rows it had not confirmed are lost with it, as a node's items are.

Pickles as its settings: a writer made on the driver and handed to a
Ray actor connects where it lands.

Who calls it: one thread of a producer (it is not thread-safe).
"""

from __future__ import annotations

import random

import numpy as np
import ray

from ..client.client import connect
from ..errors import ReplayError
from .shardhost import node_alive
from .writer import ChunkRefused, RemoteWriter

INGEST_S = 60.0  # the longest a writer waits for a shard host to hand it the shard's ingest


class ShardedWriter:
    def __init__(self, shards: list, name: str, chunk: int = 64, in_flight: int = 2):
        if not isinstance(chunk, int) or chunk < 1:
            raise ReplayError(f"chunk must be an int >= 1, got {chunk!r}")
        self.shards, self.name, self.chunk, self.in_flight = list(shards), name, chunk, in_flight
        self._reset()

    def _reset(self) -> None:
        self.client = self.table = None
        self.local = None        # the shard index this writer writes to locally
        self.writers: dict = {}  # shard -> RemoteWriter, in rotation
        self.turn, self.filled = [], 0
        self.routed = False

    def __getstate__(self):
        return {"shards": self.shards, "name": self.name, "chunk": self.chunk, "in_flight": self.in_flight}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def _route(self) -> None:
        node = ray.get_runtime_context().get_node_id()
        mine = [i for i, s in enumerate(self.shards) if s.node == node]
        if mine:
            self.local = mine[0]
            self.client = connect(self.shards[self.local].socket)
            self.table = self.client.table(self.name)
        else:
            refs = {i: s.host.ingest.remote(self.name) for i, s in enumerate(self.shards)}
            for i, ref in refs.items():
                try:
                    self.writers[i] = RemoteWriter(ray.get(ref, timeout=INGEST_S), self.chunk, self.in_flight)
                except ray.exceptions.RayActorError:
                    pass  # that shard's host (node) is gone
                except ray.exceptions.GetTimeoutError:
                    if node_alive(self.shards[i].node):
                        raise ReplayError(f"shard {i}'s host (node {self.shards[i].node[:12]}, alive) gave no "
                                          f"ingest for table {self.name!r} within {INGEST_S} s: is its node "
                                          "overloaded? write again to retry") from None
            if not self.writers:
                raise ReplayError(f"no shard of table {self.name!r} can be reached to write to")
            self.turn = list(self.writers)
            random.shuffle(self.turn)
        self.routed = True

    @property
    def shard(self) -> int | None:
        """The shard this writer writes to on its own node (None: remote, in turn)."""
        return self.local

    def insert(self, priority=None, **fields) -> None:
        """One row; ``priority=None``: the shard's largest priority so far."""
        if not self.routed:
            self._route()
        if self.table is not None:
            self.table.insert(priority=priority, **fields)
            return
        self._send(lambda w: w.insert(priority=priority, **fields), 1)

    def insert_batch(self, data: dict, priorities=None) -> None:
        """Rows with a leading dimension (chunks of ``chunk``, in turn)."""
        if not self.routed:
            self._route()
        if self.table is not None:
            self.table.insert_batch(data, priorities)
            return
        n, lo = len(next(iter(data.values()))), 0
        while lo < n:  # each piece fills the current shard's chunk
            hi = min(n, lo + self.chunk - self.filled)
            part = {k: np.asarray(v)[lo:hi] for k, v in data.items()}
            p = None if priorities is None else np.asarray(priorities)[lo:hi]
            self._send(lambda w: w.insert_batch(part, p), hi - lo)
            lo = hi

    def _send(self, fn, rows: int) -> None:
        """``fn`` on the writer whose turn it is; the turn moves on after
        ``chunk`` rows.  A shard lost for good leaves the rotation."""
        while self.turn:
            shard = self.turn[0]
            try:
                fn(self.writers[shard])
                break
            except ChunkRefused:
                self._leave(shard)
                self.filled = 0
        else:
            raise ReplayError(f"every shard of table {self.name!r} is lost")
        self.filled += rows
        if self.filled >= self.chunk:
            self.filled = 0
            self.turn.append(self.turn.pop(0))

    def _leave(self, shard: int) -> None:
        """After ``ChunkRefused`` from a shard's writer: the shard leaves the
        rotation if its node is gone for good; else the refusal stands
        (re-raised: call it inside the ``except``)."""
        if node_alive(self.shards[shard].node):
            raise
        self.turn.remove(shard)
        del self.writers[shard]

    def flush(self) -> None:
        """Every row inserted so far is in its shard's table (confirmed)."""
        if self.client is not None:
            self.client.flush()
        for shard in list(self.turn):
            try:
                self.writers[shard].flush()
            except ChunkRefused:
                self._leave(shard)

    def close(self) -> None:
        self.flush()
        if self.client is not None:
            self.client.close()
            self.client = self.table = None

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
