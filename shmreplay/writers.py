"""Writers that turn an actor's per-step stream into table items, written
straight into reserved slots (no staging copy of whole items).

* ``SequenceWriter(table, length=80, period=40)``: R2D2/IMPALA sequences.
* ``NStepWriter(table, n=3, gamma=0.99)``: Ape-X/DQN n-step transitions.

Both hold a few slots open at a time (an item starts before it is complete)
and commit them in the order they were opened, which is also the order they
complete in, so one writer's slots come from its own leases (``SlotStream``)
and are committed in lease order like any insert.  A writer that dies holding
slots loses only its unfinished items: the daemon reclaims the slots with its
lease.  Same threading rule as ``Table``: one thread per writer.
"""

from __future__ import annotations

import collections

import numpy as np

from . import commands as C
from .client import _deadline_of, reserve
from .errors import FieldError, ReplayError


class SlotStream:
    """A writer's own slot leases: ``take()`` the next slot; ``commit()``
    slots in the order they were taken.  Rate-limited tables lease one slot
    at a time, so the limiter admits each item as it starts."""

    def __init__(self, table, timeout: float | None):
        self.table = table
        self.timeout = timeout
        self.size = max(1, table._lease_size)
        self.lease = None  # [rid, slots, next position]

    def take(self) -> tuple[int, int, int]:
        """(reservation id, position in it, slot) of the next free slot."""
        lease = self.lease
        if lease is None or lease[2] == lease[1].shape[0]:
            rid, _, slots = reserve(self.table, self.size, _deadline_of(self.timeout))
            lease = self.lease = [rid, slots, 0]
        pos = lease[2]
        lease[2] = pos + 1
        return lease[0], pos, int(lease[1][pos])

    def commit(self, rid: int, pos: int, priority: float | None) -> None:
        t = self.table
        prio = () if priority is None else (t._priorities([priority], 1, "commit"),)
        t._client._send(C.COMMIT, t.id, a0=rid, a1=1, a2=pos, payload=prio)

    def close(self, abandoned=()) -> None:
        """Hand back the unused slots, and the slots of ``abandoned`` items
        ((rid, pos, slot) taken but never to be committed; none may precede
        a committed one in its lease)."""
        lease, self.lease = self.lease, None
        rids = {rid for rid, _, _ in abandoned}
        if lease is not None and lease[2] < lease[1].shape[0]:
            rids.add(lease[0])
        for rid in sorted(rids):
            self.table._client._send(C.ABORT, self.table.id, a0=rid)


def _as_step(table, field, value, shape) -> np.ndarray:
    a = np.asarray(value)
    if a.shape != shape:
        raise FieldError(f"table {table.name!r}, field {field!r}: step shape {a.shape}, "
                         f"expected {shape}")
    dtype = table.spec.field(field).dtype
    if a.dtype != dtype and not np.can_cast(a.dtype, dtype, "same_kind"):
        raise FieldError(f"table {table.name!r}, field {field!r}: dtype {a.dtype} cannot be "
                         f"stored as {dtype}")
    return a


class SequenceWriter:
    """Fixed-length overlapping sequences from a per-step stream.

    The table's *time fields* have leading dimension ``length``: step t of a
    sequence goes to row ``[slot, t]``.  A scalar integer ``length_field``
    (default ``"length"``) records how many steps are real; at an episode
    end every open sequence is padded with zeros and committed.  Other
    fields are *per-sequence* (e.g. the recurrent state at the start): the
    value given with a sequence's first step is stored.  A new sequence
    starts every ``period`` steps of an episode, so consecutive sequences
    share ``length - period`` steps.  One priority per sequence:
    ``priority_fn(item)`` gets the finished item as a dict of views into its
    slot and returns a float; None means the table's max priority.

        w = shmreplay.SequenceWriter(table, length=80, period=40)
        for step in episode:
            w.append(obs=o, action=a, reward=r, core_state=h)
        w.end_episode()
    """

    def __init__(self, table, length: int, period: int, priority_fn=None,
                 length_field: str = "length", timeout: float | None = None):
        if not (isinstance(length, int) and isinstance(period, int) and length >= 1 and period >= 1):
            raise ReplayError(f"length and period must be ints >= 1, got {length!r}, {period!r}")
        spec = table.spec
        names = {f.name: f for f in spec.fields}
        lf = names.get(length_field)
        if lf is None or lf.shape != () or lf.dtype.kind not in "iu":
            raise FieldError(f"table {table.name!r} needs a scalar integer field {length_field!r} "
                             "for the valid length of each sequence")
        self.time_fields = [f.name for f in spec.fields
                            if f.name != length_field and f.shape[:1] == (length,)]
        self.seq_fields = [f.name for f in spec.fields
                           if f.name != length_field and f.shape[:1] != (length,)]
        if not self.time_fields:
            raise FieldError(f"table {table.name!r} has no field with leading dimension {length}")
        self.step_shapes = {n: names[n].shape[1:] for n in self.time_fields}
        self.step_shapes.update({n: names[n].shape for n in self.seq_fields})
        self.table, self.length, self.period = table, length, period
        self.length_field, self.priority_fn = length_field, priority_fn
        self.views = table._views
        self.stream = SlotStream(table, timeout)
        self.open: collections.deque = collections.deque()  # [rid, pos, slot, steps written]
        self.t = 0  # steps of the current episode so far

    def append(self, **step) -> None:
        """Add one step: every time field and per-sequence field, unbatched."""
        if step.keys() != self.step_shapes.keys():
            raise FieldError(f"table {self.table.name!r}: a step needs exactly the fields "
                             f"{sorted(self.step_shapes)}, got {sorted(step)}")
        arrays = {k: _as_step(self.table, k, v, self.step_shapes[k]) for k, v in step.items()}
        if self.t % self.period == 0:
            rid, pos, slot = self.stream.take()
            for name in self.seq_fields:
                self.views[name][slot] = arrays[name]
            self.open.append([rid, pos, slot, 0])
        for item in self.open:
            slot, i = item[2], item[3]
            for name in self.time_fields:
                self.views[name][slot, i] = arrays[name]
            item[3] = i + 1
        self.t += 1
        while self.open and self.open[0][3] == self.length:
            self._commit(self.open.popleft())

    def _commit(self, item) -> None:
        rid, pos, slot, n = item
        if n < self.length:
            for name in self.time_fields:
                self.views[name][slot, n:] = 0
        self.views[self.length_field][slot] = n
        prio = None
        if self.priority_fn is not None:
            prio = self.priority_fn({f: self.views[f][slot] for f in self.views})
        self.stream.commit(rid, pos, prio)

    def end_episode(self) -> None:
        """Pad and commit every open sequence; the next step starts an episode."""
        while self.open:
            self._commit(self.open.popleft())
        self.t = 0

    def close(self) -> None:
        """End the episode (open sequences are committed, padded) and hand back unused slots."""
        self.end_episode()
        self.stream.close()

    def __enter__(self) -> "SequenceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NStepWriter:
    """n-step transitions from a per-step stream (Ape-X, Rainbow, R2D2's TD targets).

    The table needs fields ``obs`` and ``next_obs`` (same shape and dtype),
    ``action``, and scalar float ``reward`` and ``discount``; any other field
    is taken from the step the transition starts at.  For the transition
    starting at step t, with m = min(n, steps left in the episode)::

        reward   = r_t + gamma r_{t+1} + ... + gamma^(m-1) r_{t+m-1}
        discount = 0 if the episode terminated within those m steps, else gamma^m
        next_obs = the observation after step t+m-1

    so the learner's target is ``reward + discount * V(next_obs)``.  A
    truncated episode (time limit) bootstraps: discount stays gamma^m.

        w = shmreplay.NStepWriter(table, n=3, gamma=0.99)
        w.append(obs=o, action=a, reward=r, next_obs=o2, terminated=term, truncated=trunc)
    """

    REQUIRED = ("obs", "action", "reward", "discount", "next_obs")

    def __init__(self, table, n: int = 3, gamma: float = 0.99, priority_fn=None,
                 timeout: float | None = None):
        if not isinstance(n, int) or n < 1:
            raise ReplayError(f"n must be an int >= 1, got {n!r}")
        if not 0.0 <= gamma <= 1.0:
            raise ReplayError(f"gamma must be in [0, 1], got {gamma}")
        spec = table.spec
        names = {f.name: f for f in spec.fields}
        missing = [k for k in self.REQUIRED if k not in names]
        if missing:
            raise FieldError(f"table {table.name!r} lacks the n-step field(s) {missing}")
        for k in ("reward", "discount"):
            if names[k].shape != () or names[k].dtype.kind != "f":
                raise FieldError(f"table {table.name!r}: field {k!r} must be a scalar float")
        if names["obs"].shape != names["next_obs"].shape or names["obs"].dtype != names["next_obs"].dtype:
            raise FieldError(f"table {table.name!r}: obs and next_obs must have the same shape and dtype")
        self.extras = [f.name for f in spec.fields if f.name not in self.REQUIRED]
        self.step_shapes = {k: names[k].shape for k in ("obs", "action", "next_obs", *self.extras)}
        self.table, self.n, self.gamma, self.priority_fn = table, n, float(gamma), priority_fn
        self.views = table._views
        self.stream = SlotStream(table, timeout)
        self.open: collections.deque = collections.deque()  # [rid, pos, slot, return, steps]

    def append(self, obs, action, reward, next_obs, terminated: bool = False,
               truncated: bool = False, **extras) -> None:
        """One environment step: ``obs`` -- ``action`` --> ``reward``, ``next_obs``."""
        if extras.keys() != set(self.extras):
            raise FieldError(f"table {self.table.name!r}: extra step fields must be exactly "
                             f"{sorted(self.extras)}, got {sorted(extras)}")
        t = self.table
        step = {"obs": obs, "action": action, "next_obs": next_obs, **extras}
        arrays = {k: _as_step(t, k, v, self.step_shapes[k]) for k, v in step.items()}
        r = float(reward)
        if not np.isfinite(r):
            raise ReplayError(f"reward must be finite, got {reward!r}")
        rid, pos, slot = self.stream.take()
        for k in ("obs", "action", *self.extras):
            self.views[k][slot] = arrays[k]
        self.open.append([rid, pos, slot, 0.0, 0])
        for item in self.open:
            item[3] += self.gamma ** item[4] * r
            item[4] += 1
        if terminated or truncated:
            while self.open:
                self._commit(self.open.popleft(), arrays["next_obs"], bool(terminated))
            return
        if self.open[0][4] == self.n:
            self._commit(self.open.popleft(), arrays["next_obs"], False)

    def _commit(self, item, next_obs, terminated: bool) -> None:
        rid, pos, slot, ret, m = item
        v = self.views
        v["reward"][slot] = ret
        v["discount"][slot] = 0.0 if terminated else self.gamma ** m
        v["next_obs"][slot] = next_obs
        prio = None
        if self.priority_fn is not None:
            prio = self.priority_fn({f: v[f][slot] for f in v})
        self.stream.commit(rid, pos, prio)

    def close(self) -> None:
        """Drop unfinished transitions (their slots go back) and unused slots.

        A transition is finished only by n steps or the episode's end; one
        cut short by close() has no next_obs to bootstrap from."""
        # open items are the newest taken, so nothing committed follows them
        abandoned = [item[:3] for item in self.open]
        self.open.clear()
        self.stream.close(abandoned)

    def __enter__(self) -> "NStepWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
