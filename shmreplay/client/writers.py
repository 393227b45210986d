"""Writers that turn an actor's per-step stream into table items, written
straight into reserved slots (no staging copy of whole items).

* ``SequenceWriter(table, length=80, period=40)``: R2D2/IMPALA sequences.
* ``NStepWriter(table, n=3, gamma=0.99)``: Ape-X/DQN n-step transitions.

Both hold a few slots open at a time (an item starts before it is complete)
and commit them in the order they were opened, which is also the order they
complete in, so one writer's slots come from its own ``SlotLease`` and are
committed in lease order like any insert.  The lease checks, before every
copy, that its slots are still this client's; a writer whose client
reconnected after a daemon restart drops the items it had open (their
slots died with the old daemon; the next ``flush()`` says items may be
lost) and goes on with the next step.  A writer that dies holding slots
loses only its unfinished items: the daemon reclaims the slots with its
lease.  Writers use only the table's public and lease API.  Same threading
rule as ``Table``: one thread per writer.
"""

from __future__ import annotations

import collections

import numpy as np

from ..errors import FieldError, ReplayError
from .envstreams import EnvStreams
from .openitems import OpenItem, OpenTransition, as_step, frame_refs, frame_store, roles_of
from .pipe import deadline_of


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
                 length_field: str = "length", timeout: float | None = None, autoreset: str = "next_step"):
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
        self.timeout = timeout
        self.lease = table.lease()
        self.open: collections.deque[OpenItem] = collections.deque()
        self.t = 0  # steps of the current episode so far
        # a frame table's framed fields (docs/frames.md): a sequence's steps
        # kept with the item until it commits; the window reaches back over
        # one sequence, which holds the next one's overlap
        self.frames, self.framed = frame_store(table, length + 2, timeout)
        self.envs = EnvStreams(lambda: SequenceWriter(table, length, period, priority_fn, length_field, timeout),
                               autoreset)

    def append(self, **step) -> None:
        """Add one step: every time field and per-sequence field, unbatched."""
        if step.keys() != self.step_shapes.keys():
            raise FieldError(f"table {self.table.name!r}: a step needs exactly the fields "
                             f"{sorted(self.step_shapes)}, got {sorted(step)}")
        arrays = {k: as_step(self.table, k, v, self.step_shapes[k]) for k, v in step.items()}
        self.lease.run(self._append, arrays)

    def append_batch(self, step: dict, done) -> None:
        """One step of a gymnasium vector env: ``step`` the fields batched
        over its envs, ``done`` bool[num_envs] (terminated or truncated):
        each env a stream of its own whose episode ends with its done step;
        the step after it, gymnasium's autoreset, is skipped (envstreams.py)."""
        done = np.asarray(done, dtype=bool).reshape(-1)
        for i in self.envs.counted(done.shape[0], done):
            w = self.envs.writers[i]
            w.append(**{k: v[i] for k, v in step.items()})
            if done[i]:
                w.end_episode()

    def _sync(self) -> None:
        """Start of every call that writes: deferred errors, and open
        sequences dropped if their slots died with a daemon."""
        lease = self.lease
        lease.begin()
        if lease.renewed:
            lease.renewed = False
            self.open.clear()
        lease.check()

    def _append(self, arrays: dict) -> None:
        self._sync()
        views = self.lease.views
        framed = self.framed
        if self.t % self.period == 0:
            rid, pos, slot = self.lease.take(deadline_of(self.timeout))
            stacks = {name: np.zeros(f.shape, f.dtype) for f in self.table.spec.fields
                      if (name := f.name) in framed} if framed else None
            for name in self.seq_fields:
                if name in framed:
                    stacks[name][...] = arrays[name]
                else:
                    views[name][slot] = arrays[name]
            self.open.append(OpenItem(rid, pos, slot, stacks=stacks))
        for item in self.open:
            slot, i = item.slot, item.steps
            for name in self.time_fields:
                if name in framed:
                    item.stacks[name][i] = arrays[name]
                else:
                    views[name][slot, i] = arrays[name]
            item.steps = i + 1
        while self.open and self.open[0].steps == self.length:
            self._commit(self.open.popleft())
        self.t += 1  # last: a call run again after a reconnect counts its step once

    def _commit(self, item: OpenItem) -> None:
        slot, n = item.slot, item.steps
        views = self.lease.views
        if n < self.length:
            for name in self.time_fields:
                if name not in self.framed:  # a framed field's steps past n are zeros already
                    views[name][slot, n:] = 0
        views[self.length_field][slot] = n
        prio = None
        if self.priority_fn is not None:
            prio = self.priority_fn({**{f: views[f][slot] for f in views}, **(item.stacks or {})})
        refs = None if self.frames is None else frame_refs(self, item)
        self.lease.commit(item.rid, item.pos, prio, refs)
        if self.frames is not None:
            self.frames.settle()

    def end_episode(self) -> None:
        """Pad and commit every open sequence; the next step starts an episode."""
        self.lease.run(self._end_episode)

    def _end_episode(self) -> None:
        self._sync()
        while self.open:
            self._commit(self.open.popleft())
        self.t = 0

    def close(self, timeout: float | None = None) -> None:
        """End the episode (open sequences are committed, padded, into the
        slots they already hold) and hand back unused slots.  Never waits
        for the rate limiter; ``timeout`` (default: the client's) bounds the
        wait for a reservation reply already on its way."""
        try:
            self.end_episode()
        finally:
            try:
                self.lease.release((), timeout)
            finally:
                if self.frames is not None:  # every item that referenced a frame is committed
                    self.frames.release()
                self.envs.close(timeout)

    def __enter__(self) -> "SequenceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NStepWriter:
    """n-step transitions from a per-step stream (Ape-X, Rainbow, R2D2's TD targets).

    The table needs an observation and a next-observation field (same
    shape and dtype), an action field, and scalar float reward and discount
    fields; any other field is taken from the step the transition starts
    at.  They are called ``obs``, ``next_obs``, ``action``, ``reward`` and
    ``discount`` unless ``fields`` maps these roles to the table's own names
    (``fields={"obs": "observation", "next_obs": "next_observation"}``);
    ``append`` takes the roles' names either way.  For the transition
    starting at step t, with m = min(n, steps left in the episode)::

        reward   = r_t + gamma r_{t+1} + ... + gamma^(m-1) r_{t+m-1}
        discount = 0 if the episode terminated within those m steps, else gamma^m
        next_obs = the observation after step t+m-1

    so the learner's target is ``reward + discount * V(next_obs)``.  A
    truncated episode (time limit) bootstraps: discount stays gamma^m.

        w = shmreplay.NStepWriter(table, n=3, gamma=0.99)
        w.append(obs=o, action=a, reward=r, next_obs=o2, terminated=term, truncated=trunc)
    """

    ROLES = ("obs", "action", "reward", "discount", "next_obs")

    def __init__(self, table, n: int = 3, gamma: float = 0.99, priority_fn=None,
                 timeout: float | None = None, fields: dict | None = None, autoreset: str = "next_step"):
        if not isinstance(n, int) or n < 1:
            raise ReplayError(f"n must be an int >= 1, got {n!r}")
        if not 0.0 <= gamma <= 1.0:
            raise ReplayError(f"gamma must be in [0, 1], got {gamma}")
        spec = table.spec
        names = {f.name: f for f in spec.fields}
        role = roles_of(table, self.ROLES, fields)
        missing = [f"{r} ({role[r]!r})" if role[r] != r else r for r in self.ROLES if role[r] not in names]
        if missing:
            raise FieldError(f"table {table.name!r} lacks the n-step field(s) {', '.join(missing)}; "
                             f"it has {sorted(names)}: map the roles to them with fields={{role: name}}")
        for k in ("reward", "discount"):
            f = names[role[k]]
            if f.shape != () or f.dtype.kind != "f":
                raise FieldError(f"table {table.name!r}: the {k} field {f.name!r} must be a scalar float")
        o, o2 = names[role["obs"]], names[role["next_obs"]]
        if o.shape != o2.shape or o.dtype != o2.dtype:
            raise FieldError(f"table {table.name!r}: the obs and next_obs fields ({o.name!r}, "
                             f"{o2.name!r}) must have the same shape and dtype")
        self.role = role
        self.extras = [f.name for f in spec.fields if f.name not in role.values()]
        # step values by the table's field names; the roles' values arrive by role
        self.step_shapes = {role[k]: names[role[k]].shape for k in ("obs", "action", "next_obs")}
        self.step_shapes.update({k: names[k].shape for k in self.extras})
        self.table, self.n, self.gamma, self.priority_fn = table, n, float(gamma), priority_fn
        self.timeout = timeout
        self.lease = table.lease()
        self.open: collections.deque[OpenTransition] = collections.deque()
        # a frame table's stacks (docs/frames.md), through a store whose window
        # reaches back from a transition's next_obs to its obs (n steps) and
        # that stack's first frame
        self.frames, self.framed = frame_store(
            table, max((spec.frames.depth(b) for b in spec.frames.bases), default=0) + n + 2, timeout)
        # a vector env's streams (append_batch): an n-step writer of their own each
        self.envs = EnvStreams(lambda: NStepWriter(table, n, gamma, priority_fn, timeout, fields), autoreset)

    def append(self, obs, action, reward, next_obs, terminated: bool = False,
               truncated: bool = False, **extras) -> None:
        """One environment step: ``obs`` -- ``action`` --> ``reward``, ``next_obs``."""
        if extras.keys() != set(self.extras):
            raise FieldError(f"table {self.table.name!r}: extra step fields must be exactly "
                             f"{sorted(self.extras)}, got {sorted(extras)}")
        t, role = self.table, self.role
        step = {role["obs"]: obs, role["action"]: action, role["next_obs"]: next_obs, **extras}
        arrays = {k: as_step(t, k, v, self.step_shapes[k]) for k, v in step.items()}
        r = float(reward)
        if not np.isfinite(r):
            raise ReplayError(f"reward must be finite, got {reward!r}")
        self.lease.run(self._append, arrays, r, bool(terminated), bool(truncated))

    def append_batch(self, obs, action, reward, next_obs, terminated, truncated, **extras) -> None:
        """One step of a gymnasium vector env, every argument batched over its
        envs (``reward`` of shape (num_envs,)): each env a stream of its own,
        its items exactly those ``append`` makes of its steps; the step after
        an env's episode ended is gymnasium's autoreset, no transition, and
        skipped (``autoreset="next_step"``, envstreams.py)."""
        reward = np.asarray(reward)
        if reward.ndim != 1:
            raise ReplayError(f"append_batch takes a vector env's step (reward of shape (num_envs,)), got "
                              f"reward of shape {reward.shape}: one env's step goes to append")
        n = reward.shape[0]
        term = np.asarray(terminated, dtype=bool).reshape(n)
        trunc = np.asarray(truncated, dtype=bool).reshape(n)
        for i in self.envs.counted(n, term | trunc):
            self.envs.writers[i].append(obs[i], action[i], reward[i], next_obs[i], term[i], trunc[i],
                                        **{k: v[i] for k, v in extras.items()})

    def _append(self, arrays: dict, r: float, terminated: bool, truncated: bool) -> None:
        lease = self.lease
        lease.begin()
        if lease.renewed:  # the open transitions' slots died with a daemon
            lease.renewed = False
            self.open.clear()
        lease.check()
        rid, pos, slot = lease.take(deadline_of(self.timeout))
        views = lease.views
        role = self.role
        framed = self.framed
        stacks = {} if framed else None
        for k in (role["obs"], role["action"], *self.extras):
            if k in framed:  # kept (a copy: the caller may reuse its array) until the commit
                stacks[k] = np.array(arrays[k], dtype=self.table.spec.field(k).dtype)
            else:
                views[k][slot] = arrays[k]
        self.open.append(OpenTransition(rid, pos, slot, stacks=stacks))
        gamma = self.gamma
        for item in self.open:
            item.ret += gamma ** item.steps * r
            item.steps += 1
        if terminated or truncated:
            while self.open:
                self._commit(self.open.popleft(), arrays[role["next_obs"]], bool(terminated))
            return
        if self.open[0].steps == self.n:
            self._commit(self.open.popleft(), arrays[role["next_obs"]], False)

    def _commit(self, item: OpenTransition, next_obs, terminated: bool) -> None:
        slot = item.slot
        v, role = self.lease.views, self.role
        v[role["reward"]][slot] = item.ret
        v[role["discount"]][slot] = 0.0 if terminated else self.gamma ** item.steps
        store, refs = self.frames, None
        if store is None:
            v[role["next_obs"]][slot] = next_obs
            stacks = {}
        else:  # the start's stacks and next_obs: frames stored as this writer's window lacks them
            stacks = item.stacks
            if role["next_obs"] in self.framed:
                stacks[role["next_obs"]] = next_obs
            else:
                v[role["next_obs"]][slot] = next_obs
        prio = None
        if self.priority_fn is not None:
            prio = self.priority_fn({**{f: v[f][slot] for f in v}, **stacks})
        if store is not None:
            refs = frame_refs(self, item)
        self.lease.commit(item.rid, item.pos, prio, refs)
        if store is not None:
            store.settle()

    def close(self, timeout: float | None = None) -> None:
        """Drop unfinished transitions (their slots go back) and unused slots.

        A transition is finished only by n steps or the episode's end; one
        cut short by close() has no next_obs to bootstrap from.  Never
        waits for the rate limiter; ``timeout`` (default: the client's)
        bounds the wait for a reservation reply already on its way."""
        # open items are the newest taken, so nothing committed follows them
        abandoned = [] if self.lease.renewed else [(o.rid, o.pos, o.slot) for o in self.open]
        self.open.clear()
        try:
            self.lease.release(abandoned, timeout)
        finally:
            if self.frames is not None:  # no open item references a frame: they commit with theirs
                self.frames.release()
            self.envs.close(timeout)

    def __enter__(self) -> "NStepWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
