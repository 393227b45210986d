"""Issue 38, item 3: writers take a gymnasium vector env's batched steps
(one stream an env, gymnasium 1.x's next-step autoreset skipped), and
``insert`` takes the (1, ...) arrays a one-env vector env returns.  The
reference is each env stepped on its own (same seeds, same actions)
through a plain ``append``: a vector env's items for env i are exactly
those, in order."""

import gymnasium as gym
import numpy as np
import pytest

import shmreplay
from readback import committed

FIELDS = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ()),
          "discount": ("float32", ()), "next_obs": ("float32", (4,)), "env": ("int64", ())}
ENVS, STEPS, SEED = 3, 120, 7


def action(env: int, k: int) -> int:
    """Env ``env``'s k-th action of its own (a pattern long enough to vary episodes)."""
    return (k * (env + 2) // 3) % 2


def by_env(got: dict, env: int) -> dict:
    keep = got["env"] == env
    return {k: v[keep] for k, v in got.items()}


def test_nstep_writer_takes_a_vector_envs_steps_as_one_stream_an_env(client):
    vec = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * ENVS)
    t = client.create_table("vec", 10_000, FIELDS)
    counts = [0] * ENVS  # actions by each env's own step count: the reset step's is ignored
    obs, _ = vec.reset(seed=SEED)
    ended = np.zeros(ENVS, bool)
    with shmreplay.NStepWriter(t, n=3, gamma=0.9) as w:
        for _ in range(STEPS):
            acts = np.array([action(i, counts[i]) for i in range(ENVS)])
            nxt, rew, term, trunc, _ = vec.step(acts)
            w.append_batch(obs, acts, rew, nxt, term, trunc, env=np.arange(ENVS))
            for i in range(ENVS):
                counts[i] += not ended[i]
            ended = term | trunc
            obs = nxt
    vec.close()
    t.flush()
    got, _ = committed(t)
    for i in range(ENVS):
        ref = client.create_table(f"ref{i}", 10_000, FIELDS)
        env = gym.make("CartPole-v1")
        o, _ = env.reset(seed=SEED + i)  # how SyncVectorEnv seeds env i
        with shmreplay.NStepWriter(ref, n=3, gamma=0.9) as w:
            for k in range(counts[i]):
                o2, r, te, tr, _ = env.step(action(i, k))
                w.append(o, action(i, k), r, o2, te, tr, env=i)
                o = env.reset()[0] if te or tr else o2
        ref.flush()
        want, _ = committed(ref)
        mine = by_env(got, i)
        assert len(mine["obs"]) > 0 and len(mine["obs"]) == len(want["obs"]), (i, len(mine["obs"]))
        for k in FIELDS:
            np.testing.assert_array_equal(mine[k], want[k], err_msg=f"env {i}, {k}")
    assert sum(counts) < ENVS * STEPS  # some steps were autoresets, and skipped


def test_sequence_writer_takes_a_vector_envs_steps_and_ends_each_envs_episodes():
    """Two envs' streams of steps (x, done), as a vector env gives them: after
    an env's done step comes its autoreset step (x = -1 here, never a
    transition).  Each env's sequences are those a SequenceWriter of its
    own makes of its steps, ending its episodes at its done steps."""
    seq = {"x": ("int64", (4,)), "length": ("int32", ()), "env": ("int64", ())}
    streams = [[(100 * i + k, k in ends) for k in range(14)] for i, ends in ((0, {4, 9}), (1, {6}))]
    with shmreplay.Server() as server, server.connect() as c:
        t = c.create_table("s", 1000, seq)
        w = shmreplay.SequenceWriter(t, length=4, period=2)
        pos, resetting = [0, 0], [False, False]
        while all(p < len(s) for p, s in zip(pos, streams)):
            x, done = np.empty(2, np.int64), np.zeros(2, bool)
            for i in range(2):
                if resetting[i]:
                    x[i], resetting[i] = -1, False  # gymnasium's reset step: terminated False
                else:
                    x[i], done[i] = streams[i][pos[i]]
                    pos[i] += 1
                    resetting[i] = bool(done[i])
            w.append_batch({"x": x, "env": np.arange(2)}, done)
        w.close()
        t.flush()
        got, _ = committed(t)
        assert -1 not in got["x"]
        for i in range(2):
            ref = c.create_table(f"ref{i}", 1000, seq)
            with shmreplay.SequenceWriter(ref, length=4, period=2) as rw:
                for x, done in streams[i][:pos[i]]:
                    rw.append(x=x, env=i)
                    if done:
                        rw.end_episode()
            ref.flush()
            want, _ = committed(ref)
            mine = by_env(got, i)
            assert len(want["x"]) > 3
            for k in seq:
                np.testing.assert_array_equal(mine[k], want[k], err_msg=f"env {i}, {k}")


def test_insert_takes_a_one_env_vector_envs_arrays(client):
    t = client.create_table("one", 100, FIELDS)
    obs = np.ones((1, 4), np.float32)
    t.insert(obs=obs, action=np.array([1]), reward=np.array([0.5], np.float32), discount=np.array([0.9]),
             next_obs=obs * 2, env=np.array([0]))
    t.flush()
    got, _ = committed(t)
    assert got["obs"].tolist() == [[1.0] * 4] and got["next_obs"].tolist() == [[2.0] * 4]
    assert got["action"].tolist() == [1] and got["reward"].tolist() == [0.5]
    with pytest.raises(shmreplay.FieldError, match=r"shape \(2, 4\), expected \(4,\) \(or \(1, 4\) from a "
                                                   r"one-env vector env\)"):
        t.insert(obs=np.ones((2, 4)), action=1, reward=0.5, discount=0.9, next_obs=obs[0], env=0)
