"""stable-baselines3's replay buffers over a shmreplay table: one line in a
program that has them (issue 38)::

    import shmreplay.sb3
    model = DQN("MlpPolicy", env, replay_buffer_class=shmreplay.sb3.ReplayBuffer)

``ReplayBuffer`` and ``DictReplayBuffer`` (dict observations) take SB3's
constructor arguments (``buffer_size``, the spaces, ``device``, ``n_envs``,
``optimize_memory_usage``, ``handle_timeout_termination``) and keep its
semantics: ``add`` stores an env step of every env (``n_envs`` transitions,
actions reshaped to ``(n_envs, action_dim)``, a ``TimeLimit.truncated``
info stored apart so that ``sample`` reports a timeout as not done),
``sample(batch_size, env)`` draws uniformly with replacement and returns
``ReplayBufferSamples`` of tensors on ``device`` (observations and rewards
normalized by a ``VecNormalize`` env), ``size()`` counts rows of ``n_envs``
transitions up to ``buffer_size // n_envs``.  What is new goes in
``replay_buffer_kwargs``:

* ``table="replay", socket=PATH``: the table of that name on a running
  daemon (made if missing), which several SB3 processes, or actors
  elsewhere, feed together; each samples from all of it.  Without
  ``socket`` the buffer starts a private daemon (``shmreplay.Server``)
  and stops it on ``close`` or at exit;
* ``frames={"obs": 4, "next_obs": "obs"}``: Atari's stacked observations
  (SB3 hands them channel-first, ``(4, 84, 84)``) stored as frames, each
  once (docs/frames.md): ~7.7 KB a transition instead of 56 KB;
* ``storage_dir=DIR``: a table in a file, for buffers larger than RAM;
* ``seed=N``: the private daemon's sampler seed, so that a run's draws
  repeat (with the same adds and samples in the same order); refused with
  ``socket=`` (a shared daemon is seeded by its own config);
* ``ahead=True`` (the default): each batch is drawn in the daemon while
  SB3 trains on the last one (``Table.sample(..., ahead=True)``,
  docs/guide.md).  A batch lacks the transitions added after it was sent,
  and in SB3's loops there are none once the loop's rhythm is known (its
  second round on): DQN's first batch after a rollout is drawn at the
  call (its early draw, sent before the rollout, is dropped) and the rest
  of the round follow with no add between; with one add between samples
  (``train_freq=1``) the draw is sent after it.  SB3's DQN on CartPole
  ran at 0.84-0.97x (median 0.96x) the wall time of SB3's own buffer with
  it, 0.76x without (clients/sb3_dqn.py; docs/guide.md).
  ``ahead=False`` draws each batch at the call.

``reset()`` empties a buffer whose table it made; a shared table is left
to its owner (``shmreplay drop``).  ``optimize_memory_usage`` is taken
and ignored: ``frames`` does what it does, for any n-step or stack.
Pickling the buffer (``save_replay_buffer``) is refused: the data lives
in the daemon (``client.checkpoint``).  Imports stable-baselines3 and
torch; ``import shmreplay`` imports neither.  One thread at a time, SB3's.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples

from .client import Server, connect
from .client.private_daemon import buffer_options
from .errors import ReplayError

TABLE = "replay"


class _TableBuffer(BaseBuffer):
    """The parts both buffers share: the table, add, sample, size, reset."""

    def __init__(self, buffer_size, observation_space, action_space, device="auto", n_envs: int = 1,
                 optimize_memory_usage: bool = False, handle_timeout_termination: bool = True,
                 table: str | None = None, socket: str | None = None, frames: dict | None = None,
                 storage_dir: str | None = None, timeout: float | None = 60.0, seed: int | None = None,
                 ahead: bool = True):
        super().__init__(buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.capacity = max(int(buffer_size), 1)      # transitions, all envs together
        self.buffer_size = max(self.capacity // n_envs, 1)  # rows of n_envs, as SB3 counts them
        self.handle_timeout_termination = handle_timeout_termination
        self.optimize_memory_usage = False
        self.timeout = timeout
        self.ahead = bool(ahead)
        fields = {**self._obs_fields(), "action": (self._action_dtype(), (self.action_dim,)),
                  "reward": ("float32", ()), "done": ("float32", ()), "timed_out": ("float32", ())}
        spec = dict(name=table or TABLE, capacity=self.capacity, fields=fields, sampler="uniform",
                    remover="fifo", **({"frames": frames} if frames else {}),
                    **({"storage_dir": storage_dir} if storage_dir else {}))
        self._spec, self._owned = spec, socket is None
        opts = buffer_options(socket, storage_dir, seed)  # before anything starts: it may refuse
        self._server = Server(**opts) if socket is None else None
        self._client = self._server.connect() if socket is None else connect(socket)
        self._table = self._client.create_table(exist_ok=True, **spec)
        self._names = tuple(fields)

    # ---- what the two buffers store differently ----
    def _obs_fields(self) -> dict:
        raise NotImplementedError

    def _obs_values(self, obs, next_obs) -> dict:
        raise NotImplementedError

    def _samples(self, d: dict, env):
        raise NotImplementedError

    def _action_dtype(self) -> str:
        dt = np.dtype(self.action_space.dtype)
        return "float32" if dt == np.float64 else dt.name  # as SB3 casts float64 actions

    # ---- SB3's interface ----
    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        n = self.n_envs
        values = self._obs_values(obs, next_obs)
        values["action"] = np.asarray(action).reshape((n, self.action_dim))
        values["reward"] = np.asarray(reward, np.float32).reshape(n)
        values["done"] = np.asarray(done, np.float32).reshape(n)
        values["timed_out"] = np.asarray([float(self.handle_timeout_termination
                                              and info.get("TimeLimit.truncated", False)) for info in infos],
                                       np.float32).reshape(n)
        if n == 1:
            self._table.insert(timeout=self.timeout, **{k: v[0] for k, v in values.items()})
        else:
            self._table.insert_batch(values, timeout=self.timeout)
        self.pos = len(self._table) // n  # SB3's counters, for code that reads them
        self.full = self.pos >= self.buffer_size

    def size(self) -> int:
        """Rows of ``n_envs`` transitions the table holds (SB3's count);
        this process's last inserts count once the daemon applied them
        (a sample, or ``flush``, makes sure)."""
        return min(self.buffer_size, len(self._table) // self.n_envs)

    def sample(self, batch_size: int, env=None):
        """``batch_size`` transitions drawn uniformly (with replacement) from
        the whole table, as tensors on ``device``; drawn ahead (the module
        docstring says what a batch then lacks)."""
        d = self._table.sample(batch_size, timeout=self.timeout, ahead=self.ahead).data
        return self._samples(d, env)

    def _get_samples(self, batch_inds, env=None):  # BaseBuffer's abstract; sample() draws in the daemon
        raise ReplayError("a shmreplay buffer draws in its daemon: call sample(batch_size)")

    def _done(self, d: dict) -> np.ndarray:
        return (d["done"] * (1.0 - d["timed_out"])).reshape(-1, 1)

    def reset(self) -> None:
        super().reset()
        if not self._owned:
            raise ReplayError(f"reset() would drop table {self._spec['name']!r}, which other processes "
                              "share; drop it with `shmreplay drop` if you mean to")
        self._client.drop_table(self._spec["name"])
        self._table = self._client.create_table(**self._spec)

    # ---- shmreplay's ----
    @property
    def table(self):
        """The ``shmreplay.Table`` under the buffer (stats, flush, priorities)."""
        return self._table

    def close(self) -> None:
        """Close the client, and stop the private daemon if the buffer made one."""
        self._client.close()
        if self._server is not None:
            self._server.stop(check=False)
            self._server = None

    def __getstate__(self):
        raise ReplayError("a shmreplay buffer's data lives in its daemon and is not pickled: "
                          "checkpoint the table (client.checkpoint) instead of save_replay_buffer")


class ReplayBuffer(_TableBuffer):
    """SB3's ``ReplayBuffer`` over a shmreplay table (module docstring)."""

    def _obs_fields(self) -> dict:
        dt = np.dtype(self.observation_space.dtype).name
        return {"obs": (dt, self.obs_shape), "next_obs": (dt, self.obs_shape)}

    def _obs_values(self, obs, next_obs) -> dict:
        shape = (self.n_envs, *self.obs_shape)
        return {"obs": np.asarray(obs).reshape(shape), "next_obs": np.asarray(next_obs).reshape(shape)}

    def _samples(self, d: dict, env) -> ReplayBufferSamples:
        t = self.to_torch
        return ReplayBufferSamples(
            t(self._normalize_obs(d["obs"], env), copy=False), t(d["action"], copy=False),
            t(self._normalize_obs(d["next_obs"], env), copy=False), t(self._done(d), copy=False),
            t(self._normalize_reward(d["reward"].reshape(-1, 1), env), copy=False))


class DictReplayBuffer(_TableBuffer):
    """SB3's ``DictReplayBuffer`` (dict observation spaces): each key a field
    pair ``obs.<key>``-like, ``obs_<key>`` and ``next_obs_<key>``."""

    def __init__(self, buffer_size, observation_space, action_space, *args, **kwargs):
        if not isinstance(observation_space, spaces.Dict):
            raise ReplayError("DictReplayBuffer takes a Dict observation space; use ReplayBuffer")
        super().__init__(buffer_size, observation_space, action_space, *args, **kwargs)

    def _obs_fields(self) -> dict:
        out = {}
        for key, shape in self.obs_shape.items():
            dt = np.dtype(self.observation_space[key].dtype).name
            out[f"obs_{key}"] = (dt, shape)
            out[f"next_obs_{key}"] = (dt, shape)
        return out

    def _obs_values(self, obs, next_obs) -> dict:
        out = {}
        for key, shape in self.obs_shape.items():
            out[f"obs_{key}"] = np.asarray(obs[key]).reshape((self.n_envs, *shape))
            out[f"next_obs_{key}"] = np.asarray(next_obs[key]).reshape((self.n_envs, *shape))
        return out

    def _samples(self, d: dict, env) -> DictReplayBufferSamples:
        obs = self._normalize_obs({k: d[f"obs_{k}"] for k in self.obs_shape}, env)
        nxt = self._normalize_obs({k: d[f"next_obs_{k}"] for k in self.obs_shape}, env)
        t = self.to_torch
        return DictReplayBufferSamples(
            {k: t(v, copy=False) for k, v in obs.items()}, t(d["action"], copy=False),
            {k: t(v, copy=False) for k, v in nxt.items()}, t(self._done(d), copy=False),
            t(self._normalize_reward(d["reward"].reshape(-1, 1), env), copy=False))
