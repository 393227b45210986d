"""``shmreplay.ray``: actors anywhere on a Ray cluster feed the replay on the learner's node.

Optional (``pip install "shmreplay[ray]"``), imported only when used.
Replay stays on the learner's box; remote producers cannot map its shared
memory, so they send chunks of rows through Ray's object store to an
*ingest* actor pinned to the daemon's node, which inserts them as an
ordinary local client.

    # on the replay node (where shmreplayd and the learner run), after ray.init():
    ingest = shmreplay.ray.start_ingest(socket_path, "replay")
    # in any Ray actor or task, on any node:
    w = shmreplay.ray.RemoteWriter(ingest, chunk=64, in_flight=2)
    w.insert(obs=o, action=a, reward=r)        # or insert_batch({...}, priorities)
    w.flush()                                   # every row so far is committed

* **Placement.**  ``start_ingest`` schedules the ingest with
  ``NodeAffinitySchedulingStrategy(node_id, soft=False)`` on the node that
  calls it (or ``node_id=``): it must share /dev/shm with the daemon.
* **Zero copy on arrival.**  A chunk is a dict of numpy arrays; Ray stores
  large ones in the object store and the ingest reads them as read-only
  views of it, which ``insert_batch`` copies once, into the table's slots.
* **Back-pressure.**  A writer keeps at most ``in_flight`` chunks sent and
  unconfirmed; the next send waits for the oldest.  The ingest admits a
  chunk as the table's rate limiter admits its rows (``insert_batch``
  waits in the daemon), so a slow or rate-limited table holds remote
  producers back instead of growing memory anywhere: at most ``in_flight
  x chunk`` rows per producer exist outside the table.
* **Confirmation.**  The ingest answers a chunk once its rows are
  committed and flushed (``Client.flush``): ``w.flush()`` returning means
  every row inserted before it is in the table.  An ingest call that fails
  (the table refused the rows, the daemon went away) raises in the
  producer at its next send or ``flush``, as ``ChunkRefused`` naming why.

Priorities, rate limits and reuse limits are the table's, exactly as for a
local writer: the ingest is one.

Failures (at-least-once: nothing confirmed is lost, nothing is torn):

* **The ingest dies** (its process, its node's raylet): Ray restarts it
  (``max_restarts``, default for ever) and it reconnects.  A chunk whose
  call failed with it is sent again, up to ``retries`` times with a
  growing pause; a chunk the dead ingest had committed but not confirmed
  is then stored twice.  A re-sent chunk may land after later chunks of
  the same producer.
* **The daemon restarts under the ingest**: its client reconnects
  (``reconnect=True``) and the restarted daemon adopts the tables; a chunk
  whose flush says inserts may have been lost is sent again (again
  possibly stored twice).
* **A producer dies**: the rows it had buffered or sent unconfirmed may be
  lost; chunks already sent are inserted whole or not at all by a live
  ingest (a chunk on a rate-limited table is inserted as the limiter
  admits it; ``timeout`` bounds that).
* **Anything else the table refuses** (a wrong field, a bad priority)
  raises ``ChunkRefused`` in the producer at once, naming why.

Who calls it: ``start_ingest`` a driver or actor on the replay node;
``RemoteWriter`` one thread of a producer (it is not thread-safe).
"""

from __future__ import annotations

import collections
import time

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .errors import DaemonUnavailable, ReplayError

_RETRIABLE = (DaemonUnavailable,)

class ChunkRefused(ReplayError):
    """The ingest could not insert a chunk: the reason is the table's or the daemon's."""


class _Ingest:
    """The ingest actor: one local client of the daemon, one table."""

    def __init__(self, socket_path: str, table: str, timeout: float | None):
        import shmreplay
        self.client = shmreplay.connect(socket_path, reconnect=True)
        self.table = self.client.table(table)
        self.timeout = timeout
        self.chunks = self.rows = 0

    def insert(self, chunk: dict, priorities) -> int:
        """Insert one chunk (waiting for the table's limits), flush, and
        return how many rows; raises the table's or daemon's error."""
        self.table.insert_batch(chunk, priorities, timeout=self.timeout)
        self.client.flush()
        n = len(next(iter(chunk.values())))
        self.chunks += 1
        self.rows += n
        return n

    def stats(self) -> dict:
        return {"chunks": self.chunks, "rows": self.rows, "node": ray.get_runtime_context().get_node_id()}

    def fields(self) -> dict:
        """The table's fields, name -> (dtype, shape): remote writers build rows to fit."""
        return {f.name: (f.dtype.str, tuple(f.shape)) for f in self.table.spec.fields}


def start_ingest(socket_path: str, table: str, node_id: str | None = None, name: str | None = None,
                 timeout: float | None = None, max_restarts: int = -1):
    """An ingest actor for ``table`` of the daemon at ``socket_path``,
    pinned (``soft=False``) to ``node_id`` (default: the caller's node,
    which must be the daemon's).  ``name``: a Ray actor name, so producers
    may find it with ``ray.get_actor``.  ``timeout``: the longest a chunk
    may wait for the table's limits (None: as long as it takes; the
    producers wait with it)."""
    node = node_id or ray.get_runtime_context().get_node_id()
    opts = dict(num_cpus=0, max_restarts=max_restarts,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
    if name is not None:
        opts["name"] = name
    return ray.remote(_Ingest).options(**opts).remote(socket_path, table, timeout)


class _ParameterRelay:
    """A ``ParameterBoard`` read on the replay node for remote actors."""

    def __init__(self, socket_path: str, board: str, like: dict):
        import shmreplay
        self.client = shmreplay.connect(socket_path, reconnect=True)
        self.board = shmreplay.ParameterBoard.attach(self.client, board, like=like)

    def latest(self, newer_than: int | None = None):
        got = self.board.latest(newer_than=newer_than)
        if got is None:
            return None
        version, arrays = got
        return version, {k: np.array(v) for k, v in arrays.items()}  # the board reuses its buffer


def start_parameter_relay(socket_path: str, board: str, like: dict, node_id: str | None = None):
    """A Ray actor on the replay node that reads ``board`` (a
    ``ParameterBoard``) for actors that cannot map it: ``ray.get(
    relay.latest.remote(newer_than=v))`` is None or ``(version, {name:
    array})``, the arrays travelling through the object store."""
    node = node_id or ray.get_runtime_context().get_node_id()
    return ray.remote(_ParameterRelay).options(
        num_cpus=0, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(socket_path, board, like)


class RemoteWriter:
    """Rows from a remote producer, in chunks, with at most ``in_flight``
    chunks unconfirmed (see the module docstring)."""

    def __init__(self, ingest, chunk: int = 64, in_flight: int = 2, retries: int = 10):
        if not isinstance(chunk, int) or chunk < 1 or not isinstance(in_flight, int) or in_flight < 1:
            raise ReplayError(f"chunk and in_flight must be ints >= 1, got {chunk!r}, {in_flight!r}")
        self.ingest, self.chunk, self.in_flight, self.retries = ingest, chunk, in_flight, retries
        self.resent = 0
        self._rows: dict[str, list] = {}
        self._prios: list = []
        self._pending: collections.deque = collections.deque()  # [ref, chunk, priorities, attempts]
        self.sent = self.confirmed = 0

    def insert(self, priority=None, **fields) -> None:
        """One row (the table's fields); ``priority=None``: the table's max."""
        if self._rows and fields.keys() != self._rows.keys():
            raise ReplayError(f"a row needs the fields {sorted(self._rows)}, got {sorted(fields)}")
        if (priority is None) != (not self._prios) and self._count():
            raise ReplayError("give a priority for every row of a chunk or for none")
        for k, v in fields.items():  # a copy: the caller may reuse its buffers (an env's obs)
            self._rows.setdefault(k, []).append(np.array(v))
        if priority is not None:
            self._prios.append(float(priority))
        if self._count() >= self.chunk:
            self._send()

    def insert_batch(self, data: dict, priorities=None) -> None:
        """Rows with a leading dimension, sent in chunks of at most ``chunk``."""
        n = len(next(iter(data.values())))
        for lo in range(0, n, self.chunk):
            self._flush_rows()
            part = {k: np.ascontiguousarray(v[lo:lo + self.chunk]) for k, v in data.items()}
            self._submit(part, None if priorities is None else np.asarray(priorities[lo:lo + self.chunk]))

    def flush(self) -> None:
        """Send what is buffered and wait until every chunk is confirmed."""
        self._flush_rows()
        while self._pending:
            self._confirm_oldest()

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "RemoteWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()

    # ---- internals ----
    def _count(self) -> int:
        return len(next(iter(self._rows.values()))) if self._rows else 0

    def _flush_rows(self) -> None:
        if self._count():
            self._send()

    def _send(self) -> None:
        part = {k: np.stack(v) for k, v in self._rows.items()}
        prios = np.asarray(self._prios) if self._prios else None
        self._rows, self._prios = {}, []
        self._submit(part, prios)

    def _submit(self, part: dict, prios) -> None:
        while len(self._pending) >= self.in_flight:  # back-pressure: wait for the oldest
            self._confirm_oldest()
        self._pending.append([self.ingest.insert.remote(part, prios), part, prios, 0])
        self.sent += 1

    def _confirm_oldest(self) -> None:
        entry = self._pending[0]
        while True:
            try:
                ray.get(entry[0])
                break
            except ray.exceptions.RayActorError as exc:  # the ingest died: Ray restarts it
                why = exc
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, _RETRIABLE):
                    self._pending.popleft()
                    raise ChunkRefused(f"the ingest refused a chunk: {exc.cause!r}") from None
                why = exc.cause  # the daemon restarted: inserts since its last flush may be lost
            entry[3] += 1
            if entry[3] > self.retries:
                self._pending.popleft()
                raise ChunkRefused(f"a chunk could not be delivered in {self.retries} attempts: "
                                   f"{why!r}") from None
            time.sleep(min(2.0, 0.1 * 2 ** entry[3]))  # give Ray time to restart the ingest
            entry[0] = self.ingest.insert.remote(entry[1], entry[2])
            self.resent += 1
        self._pending.popleft()
        self.confirmed += 1


class RemoteNStepWriter:
    """``NStepWriter``'s transitions, built in the producer and sent through
    a ``RemoteWriter``: the same ``append`` and the same n-step return,
    discount and next observation (see ``shmreplay.NStepWriter``); roles map
    to the table's own names with ``fields=``.  ``priority_fn(item)`` gets
    the finished transition as a dict by field name.  ``close()`` drops
    unfinished transitions and flushes."""

    ROLES = ("obs", "action", "reward", "discount", "next_obs")

    def __init__(self, ingest, n: int = 3, gamma: float = 0.99, priority_fn=None, fields: dict | None = None,
                 chunk: int = 64, in_flight: int = 2):
        if not isinstance(n, int) or n < 1 or not 0.0 <= gamma <= 1.0:
            raise ReplayError(f"n must be an int >= 1 and gamma in [0, 1], got {n!r}, {gamma!r}")
        self.role = {r: str((fields or {}).get(r, r)) for r in self.ROLES}
        self.n, self.gamma, self.priority_fn = n, float(gamma), priority_fn
        self.writer = RemoteWriter(ingest, chunk, in_flight)
        self.open: collections.deque = collections.deque()  # [first step's values, return, steps]

    def append(self, obs, action, reward, next_obs, terminated: bool = False, truncated: bool = False,
               **extras) -> None:
        r = float(reward)
        if not np.isfinite(r):
            raise ReplayError(f"reward must be finite, got {reward!r}")
        role = self.role
        # copies: the step's values stay open for n steps, and the caller may
        # reuse its buffers meanwhile (an env's observation array)
        self.open.append([{role["obs"]: np.array(obs), role["action"]: np.array(action),
                           **{k: np.array(v) for k, v in extras.items()}}, 0.0, 0])
        for item in self.open:
            item[1] += self.gamma ** item[2] * r
            item[2] += 1
        if terminated or truncated:
            while self.open:
                self._emit(self.open.popleft(), next_obs, bool(terminated))
        elif self.open[0][2] == self.n:
            self._emit(self.open.popleft(), next_obs, False)

    def _emit(self, item, next_obs, terminated: bool) -> None:
        values, ret, m = item
        role = self.role
        row = {**values, role["reward"]: np.float32(ret),
               role["discount"]: np.float32(0.0 if terminated else self.gamma ** m),
               role["next_obs"]: np.array(next_obs)}
        prio = None if self.priority_fn is None else self.priority_fn(row)
        self.writer.insert(priority=prio, **row)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Drop unfinished transitions (no next_obs to bootstrap from) and flush."""
        self.open.clear()
        self.writer.close()


class RemoteSequenceWriter:
    """``SequenceWriter``'s fixed-length overlapping sequences, built in the
    producer: time fields are the table's fields with leading dimension
    ``length``, the scalar integer ``length_field`` records the real steps,
    other fields are taken from a sequence's first step; an episode's end
    pads and sends every open sequence (see ``shmreplay.SequenceWriter``)."""

    def __init__(self, ingest, length: int, period: int, priority_fn=None, length_field: str = "length",
                 chunk: int = 16, in_flight: int = 2):
        if not (isinstance(length, int) and isinstance(period, int) and length >= 1 and period >= 1):
            raise ReplayError(f"length and period must be ints >= 1, got {length!r}, {period!r}")
        spec = ray.get(ingest.fields.remote())
        if length_field not in spec or spec[length_field][1] != ():
            raise ReplayError(f"the table needs a scalar integer field {length_field!r}")
        self.spec = {k: (np.dtype(d), tuple(s)) for k, (d, s) in spec.items() if k != length_field}
        self.time_fields = [k for k, (_, s) in self.spec.items() if s[:1] == (length,)]
        if not self.time_fields:
            raise ReplayError(f"the table has no field with leading dimension {length}")
        self.length, self.period, self.length_field = length, period, length_field
        self.priority_fn = priority_fn
        self.writer = RemoteWriter(ingest, chunk, in_flight)
        self.open: collections.deque = collections.deque()  # [row arrays, steps written]
        self.t = 0

    def append(self, **step) -> None:
        if step.keys() != self.spec.keys():
            raise ReplayError(f"a step needs exactly the fields {sorted(self.spec)}, got {sorted(step)}")
        if self.t % self.period == 0:
            row = {k: np.zeros(s, d) for k, (d, s) in self.spec.items()}
            for k in self.spec:
                if k not in self.time_fields:
                    row[k][...] = step[k]
            self.open.append([row, 0])
        for item in self.open:
            row, i = item
            for k in self.time_fields:
                row[k][i] = step[k]
            item[1] = i + 1
        while self.open and self.open[0][1] == self.length:
            self._emit(self.open.popleft())
        self.t += 1

    def _emit(self, item) -> None:
        row, n = item
        row[self.length_field] = np.int64(n)
        prio = None if self.priority_fn is None else self.priority_fn(row)
        self.writer.insert(priority=prio, **row)

    def end_episode(self) -> None:
        while self.open:
            self._emit(self.open.popleft())  # the rest of each is zeros already
        self.t = 0

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.end_episode()
        self.writer.close()
