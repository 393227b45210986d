"""A learner's hand on one shard: an actor on the shard's node that reports
the shard's mass, draws the shard's part of a batch and packs its rows.

A ``ShardedTable`` (shardtable.py) starts one ``ShardAgent`` per shard,
pinned to the shard's node (``soft=False``), owned by the learner's
process: a learner that dies takes its agents with it, and their clients'
holds and leases go back to the daemons as any local client's do.  The
agent is an ordinary local client of the shard's daemon: it draws with
``Table.sample`` (stratified, the table's own limits and reuse rules),
gathers the rows from the node's shared memory, and packs them, with each
row's key and probability, into one array (``row_dtype``): the batch's
part travels through Ray's object store as that one array, not a call or
an array per row or per field.

Every call answers with the shard's report, read from the table's live
words in shared memory (no round trip to the daemon): a draw's answer
carries the report the learner splits its next batch by, so a batch costs
one call per shard.  A daemon that is gone (killed, restarting) makes the
report say ``down`` instead of raising, at once: the agent reconnects
(once, for at most its ``timeout``) at its next call, so a shard whose
daemon came back serves again from the next batch.  A daemon that hangs
is said by a ReplayTimeout after ``timeout`` (the table's
``shard_timeout``): the learner leaves the shard out of that batch.

Who calls it: the ``ShardedTable`` that made it; its methods run one at a
time (a Ray actor without concurrency).
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..client.client import connect
from ..errors import DaemonUnavailable, ReplayError, UnknownTable
from ..wire.peer import EXITED, process_state

ANSWER_S = 20.0  # by default, how long an agent waits for its daemon's answer (past a draw's own wait)
KEY, PROB = "_shard_key", "_shard_p"  # the packed row's key and probability
ZOMBIE_S = 1.0  # how often a report looks whether the daemon is a zombie


def _alive(pid: int, zombie_check: bool) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's daemon (a service): it exists
        pass
    # a zombie serves nothing (its parent never reaped it); /proc costs
    # ~20 us, a tenth of a local batch, so it is read once a ZOMBIE_S
    return not zombie_check or process_state(pid)[0] not in EXITED


def row_dtype(fields: list) -> np.dtype:
    """A packed row: the table's fields (``[name, dtype, shape]``, the wire
    form), then the item's key and its probability within the shard."""
    return np.dtype([(name, np.dtype(dt), tuple(shape)) for name, dt, shape in fields]
                    + [(KEY, np.uint64), (PROB, np.float64)])


class ShardAgent:
    """One learner's client of one shard's table (see the module docstring)."""

    def __init__(self, socket: str, table: str, timeout: float = ANSWER_S):
        self.socket, self.name, self.timeout = socket, table, timeout
        self.client = self.table = self.row = None
        self.zombie_checked = -ZOMBIE_S  # when a report last looked (monotonic)

    def _zombie_check(self) -> bool:
        """Whether this report looks for a zombie daemon (once a ZOMBIE_S)."""
        now = time.monotonic()
        if now - self.zombie_checked < ZOMBIE_S:
            return False
        self.zombie_checked = now
        return True

    def _table(self):
        if self.client is None:
            self.client = connect(self.socket, timeout=self.timeout)
            self.table = None
        if self.table is None:
            self.table = self.client.table(self.name)
            self.row = row_dtype([f.to_wire() for f in self.table.spec.fields])
        return self.table

    def _lose_client(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        except ReplayError:
            pass
        self.client = self.table = None

    def close(self) -> None:
        """Close the client (the learner's own agent, at the table's close)."""
        self._lose_client()

    def _call(self, fn):
        try:
            return fn(self._table())
        except DaemonUnavailable:
            self._lose_client()
            raise

    # ---- the table ----
    def create(self, kwargs: dict, queue: bool) -> dict:
        """Make this shard's table (``Client.create_table``'s or
        ``create_queue``'s arguments); returns ``describe()``."""
        if self.client is None:
            self.client = connect(self.socket, timeout=self.timeout)
        make = self.client.create_queue if queue else self.client.create_table
        make(self.name, **kwargs)
        return self.describe()

    def describe(self) -> dict:
        """The table's definition (``TableSpec.to_wire``)."""
        spec = self._call(lambda t: t.spec)
        if spec.frames:
            raise ReplayError(f"table {self.name!r} stores frames: a sharded table takes tables of rows")
        return spec.to_wire()

    def drop(self) -> None:
        if self.client is None:
            self.client = connect(self.socket, timeout=self.timeout)
        try:
            self.client.drop_table(self.name)
        except UnknownTable:
            pass
        self.table = None

    # ---- a learner's calls ----
    def report(self, answered: bool = False) -> dict:
        """The shard's mass (sum of p^alpha of its sampleable items; their
        count on a uniform or order sampler), its smallest one (``least``),
        its size and counters: read from the table's live words (no round
        trip to the daemon); ``{"down": why}`` when the daemon is gone.
        ``answered``: the daemon answered a draw just now (its process is
        not looked up in /proc again)."""
        try:
            t = self._table()
        except DaemonUnavailable as exc:
            self._lose_client()
            return {"down": str(exc)}
        except UnknownTable:
            self._lose_client()
            return {"down": f"the daemon has no table {self.name!r} (dropped, or not adopted after a restart)"}
        pid = self.client.daemon_pid
        if not answered and not _alive(pid, self._zombie_check()):  # its words stay mapped after it died
            self._lose_client()
            return {"down": f"its daemon (pid {pid}) is gone"}
        w = t.mapped.words
        mass, least = w.mass, w.least
        if mass > 0 and least == 0:  # a daemon from before the word: ask it
            least = self.client.stats()["tables"][self.name]["least"]
        return {"mass": mass, "least": least, "size": w.size, "inserts": w.inserts, "samples": w.samples}

    def draw(self, k: int, beta: float, timeout: float | None) -> tuple:
        """Draw k items; returns (the shard's report after the draw, the
        rows packed into one array of ``row_dtype``: rows, key, probability
        within the shard), or (the report, None) when the shard has nothing
        to draw now or its daemon is gone (``report`` says which)."""
        if "down" in (before := self.report()) or before["mass"] <= 0:
            return before, None
        b = self._call(lambda t: t.sample(k, beta=beta, timeout=timeout))
        out = np.empty(k, self.row)
        for name in b.data:
            out[name] = b.data[name]
        out[KEY] = b.keys
        out[PROB] = b.probabilities
        return self.report(answered=True), out

    def draw_into(self, out, beta: float, timeout: float | None) -> tuple:
        """``draw`` for the learner's own shard, in the learner's process:
        ``len(out)`` rows gathered straight into ``out`` (a ``SampleBatch``
        of views of the batch's rows), nothing packed; returns (the report,
        ``out``), or (the report, None) as ``draw``."""
        if "down" in (before := self.report()) or before["mass"] <= 0:
            return before, None
        self._call(lambda t: t.sample(len(out), beta=beta, out=out, timeout=timeout))
        return self.report(answered=True), out

    def update(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """New priorities for keys this shard gave (stale ones are skipped
        and counted by the table, as a local learner's)."""
        self._call(lambda t: t.update_priorities(keys, priorities))

    def flush(self) -> None:
        """Return once the daemon has applied every update sent so far."""
        if self.client is not None:
            self._call(lambda t: self.client.flush())

    def checkpoint(self, to: str) -> list:
        """A checkpoint of this shard's table into ``to`` on its node."""
        return self._call(lambda t: self.client.checkpoint(to, tables=self.name))

    def stats(self) -> dict:
        """The table's stats as the shard's daemon reports them, with the
        pids of the daemon's connected clients (``daemon_client_pids``)."""
        got = self._call(lambda t: self.client.stats())
        return {**got["tables"][self.name], "daemon_client_pids": [c["pid"] for c in got["client_list"]]}
