"""``RemoteNStepWriter`` and ``RemoteSequenceWriter``: the local step
writers' items, built in a remote producer and sent through a
``RemoteWriter``.

Who calls it: one thread of a producer.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import ray

from ..errors import ReplayError
from .shardwriter import ShardedWriter
from .writer import RemoteWriter


@dataclass(slots=True)
class PendingItem:
    """An item begun in the producer and not sent yet: its row so far and
    how many steps it holds."""
    row: dict
    steps: int = 0


@dataclass(slots=True)
class PendingTransition(PendingItem):
    """An n-step transition begun (``row``: its first step's values): also
    its discounted reward so far."""
    ret: float = 0.0


class RemoteNStepWriter:
    """``NStepWriter``'s transitions, built in the producer and sent through
    a ``RemoteWriter`` (or, given a sharded table's writer, ``ShardedTable.
    writer()``, through it): the same ``append`` and the same n-step return,
    discount and next observation (see ``shmreplay.NStepWriter``); roles map
    to the table's own names with ``fields=``.  ``priority_fn(item)`` gets
    the finished transition as a dict by field name.  ``close()`` drops
    unfinished transitions and flushes."""

    ROLES = ("obs", "action", "reward", "discount", "next_obs")

    def __init__(self, ingest, n: int = 3, gamma: float = 0.99, priority_fn=None, fields: dict | None = None,
                 chunk: int = 64, in_flight: int = 2, hold: int = 16):
        if not isinstance(n, int) or n < 1 or not 0.0 <= gamma <= 1.0:
            raise ReplayError(f"n must be an int >= 1 and gamma in [0, 1], got {n!r}, {gamma!r}")
        self.role = {r: str((fields or {}).get(r, r)) for r in self.ROLES}
        self.n, self.gamma, self.priority_fn = n, float(gamma), priority_fn
        self.writer = ingest if isinstance(ingest, ShardedWriter) else RemoteWriter(ingest, chunk, in_flight,
                                                                                   hold=hold)
        self.open: collections.deque[PendingTransition] = collections.deque()

    def append(self, obs, action, reward, next_obs, terminated: bool = False, truncated: bool = False,
               **extras) -> None:
        r = float(reward)
        if not np.isfinite(r):
            raise ReplayError(f"reward must be finite, got {reward!r}")
        role = self.role
        # copies: the step's values stay open for n steps, and the caller may
        # reuse its buffers meanwhile (an env's observation array)
        self.open.append(PendingTransition({role["obs"]: np.array(obs), role["action"]: np.array(action),
                                            **{k: np.array(v) for k, v in extras.items()}}))
        gamma = self.gamma
        for item in self.open:
            item.ret += gamma ** item.steps * r
            item.steps += 1
        if terminated or truncated:
            while self.open:
                self._emit(self.open.popleft(), next_obs, bool(terminated))
        elif self.open[0].steps == self.n:
            self._emit(self.open.popleft(), next_obs, False)

    def _emit(self, item: PendingTransition, next_obs, terminated: bool) -> None:
        role = self.role
        row = {**item.row, role["reward"]: np.float32(item.ret),
               role["discount"]: np.float32(0.0 if terminated else self.gamma ** item.steps),
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
                 chunk: int = 16, in_flight: int = 2, hold: int = 16):
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
        self.writer = RemoteWriter(ingest, chunk, in_flight, hold=hold)
        self.open: collections.deque[PendingItem] = collections.deque()
        self.t = 0

    def append(self, **step) -> None:
        if step.keys() != self.spec.keys():
            raise ReplayError(f"a step needs exactly the fields {sorted(self.spec)}, got {sorted(step)}")
        if self.t % self.period == 0:
            row = {k: np.zeros(s, d) for k, (d, s) in self.spec.items()}
            for k in self.spec:
                if k not in self.time_fields:
                    row[k][...] = step[k]
            self.open.append(PendingItem(row))
        for item in self.open:
            row, i = item.row, item.steps
            for k in self.time_fields:
                row[k][i] = step[k]
            item.steps = i + 1
        while self.open and self.open[0].steps == self.length:
            self._emit(self.open.popleft())
        self.t += 1

    def _emit(self, item: PendingItem) -> None:
        row = item.row
        row[self.length_field] = np.int64(item.steps)
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
