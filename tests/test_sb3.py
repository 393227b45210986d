"""Issue 38, item 1: ``shmreplay.sb3``'s buffers against stable-baselines3's
own, with real SB3: the same transitions in, the same transitions out (a
sampled row is a row SB3's buffer holds, field for field, with its
timeout handling), the same sample types, DQN training through it, and
two processes sharing one table."""

import multiprocessing

import numpy as np
import pytest

sb3 = pytest.importorskip("stable_baselines3")
import torch  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer as SB3Dict  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer  # noqa: E402

import shmreplay  # noqa: E402
import shmreplay.sb3 as srb  # noqa: E402

OBS = spaces.Box(-1.0, 1.0, (3,), np.float32)


def steps(rng, n_envs: int, k: int, obs_space=OBS, action_space=spaces.Discrete(4)):
    """k env steps of n_envs envs: (obs, next_obs, action, reward, done, infos)."""
    for i in range(k):
        obs = np.stack([obs_space.sample() for _ in range(n_envs)])
        nxt = np.stack([obs_space.sample() for _ in range(n_envs)])
        act = np.stack([action_space.sample() for _ in range(n_envs)])
        rew = rng.normal(size=n_envs).astype(np.float32)
        done = rng.random(n_envs) < 0.2
        infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
        yield obs, nxt, act, rew, done, infos


def rows_of(samples) -> set:
    """A sample's transitions, each as bytes of (obs, action, next_obs, done, reward)."""
    parts = [samples.observations, samples.actions, samples.next_observations, samples.dones, samples.rewards]
    arrays = [p.numpy().reshape(p.shape[0], -1).astype(np.float64) for p in parts]
    return {np.concatenate([a[i] for a in arrays]).tobytes() for i in range(arrays[0].shape[0])}


def test_the_buffer_holds_and_samples_what_sb3s_own_does_field_for_field():
    n_envs, act = 2, spaces.Discrete(4)
    ours = srb.ReplayBuffer(1000, OBS, act, device="cpu", n_envs=n_envs)
    theirs = SB3Buffer(1000, OBS, act, device="cpu", n_envs=n_envs)
    try:
        for step in steps(np.random.default_rng(0), n_envs, 60):
            ours.add(*step)
            theirs.add(*step)
        got = ours.sample(64)
        want = theirs.sample(64)
        assert type(got) is type(want)
        for a, b in zip(got, want):  # the same types, shapes and dtypes (None where SB3 has None)
            if b is None:
                assert a is None
                continue
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (a.shape, b.shape)
        assert ours.size() == theirs.size() == 60
        # every transition SB3 holds, each (row, env) of its arrays, a
        # timeout as not done (what its _get_samples returns for it)
        rows, envs = np.repeat(np.arange(60), n_envs), np.tile(np.arange(n_envs), 60)
        done = theirs.dones[rows, envs] * (1 - theirs.timeouts[rows, envs])
        everything = rows_of(type(want)(*(torch.as_tensor(np.asarray(a, np.float32).reshape(len(rows), -1)) for a in (
            theirs.observations[rows, envs], theirs.actions[rows, envs], theirs.next_observations[rows, envs],
            done, theirs.rewards[rows, envs]))))
        seen = set()
        for _ in range(20):
            rows = rows_of(ours.sample(64))
            assert rows <= everything
            seen |= rows
        assert len(seen) > 100  # most of the 120 transitions were drawn
        assert any(i["TimeLimit.truncated"] for s in steps(np.random.default_rng(0), n_envs, 60) for i in s[5])
    finally:
        ours.close()


def test_the_dict_buffer_does_the_same_for_dict_observations():
    obs_space = spaces.Dict({"pos": spaces.Box(-1.0, 1.0, (2,), np.float32),
                             "img": spaces.Box(0, 255, (3, 4), np.uint8)})
    act = spaces.Box(-1.0, 1.0, (2,), np.float32)
    ours = srb.DictReplayBuffer(100, obs_space, act, device="cpu", n_envs=1)
    theirs = SB3Dict(100, obs_space, act, device="cpu", n_envs=1)
    try:
        rng = np.random.default_rng(1)
        for obs, nxt, a, r, d, infos in steps(rng, 1, 30, obs_space, act):
            obs = {k: np.stack([o[k] for o in obs]) for k in obs_space}
            nxt = {k: np.stack([o[k] for o in nxt]) for k in obs_space}
            ours.add(obs, nxt, a, r, d, infos)
            theirs.add(obs, nxt, a, r, d, infos)
        got = ours.sample(16)
        want = theirs._get_samples(np.arange(30))
        for k in obs_space:
            assert got.observations[k].dtype == want.observations[k].dtype
            stored = {bytes(x) for x in want.observations[k].numpy()}
            assert {bytes(x) for x in got.observations[k].numpy()} <= stored
        assert {bytes(x) for x in got.actions.numpy()} <= {bytes(x) for x in want.actions.numpy()}
    finally:
        ours.close()


def test_dqn_trains_through_it(tmp_path):
    gym = pytest.importorskip("gymnasium")
    model = sb3.DQN("MlpPolicy", gym.make("CartPole-v1"), replay_buffer_class=srb.ReplayBuffer,
                    learning_starts=100, train_freq=4, batch_size=32, buffer_size=5000, seed=0, verbose=0)
    try:
        model.learn(600)
        assert isinstance(model.replay_buffer, srb.ReplayBuffer)
        model.replay_buffer.table.flush()  # the last adds count once the daemon applied them
        assert model._n_updates > 100 and model.replay_buffer.table.inserts == 600
        with pytest.raises(shmreplay.ReplayError, match="checkpoint the table"):
            model.save_replay_buffer(str(tmp_path / "buffer.pkl"))
    finally:
        model.replay_buffer.close()


def _add_and_sample(path, marker, out, go):
    buf = srb.ReplayBuffer(10_000, OBS, spaces.Discrete(4), device="cpu", socket=path, table="shared")
    try:
        for i in range(200):
            obs = np.full((1, 3), marker, np.float32)
            buf.add(obs, obs, np.array([i % 4]), np.array([float(i)]), np.array([False]), [{}])
        buf.table.flush()
        out.put("added")
        assert go.wait(120)  # both processes' rows are in (flushed) before either samples
        seen = set()
        for _ in range(200):
            seen |= set(np.unique(buf.sample(64).observations.numpy()[:, 0]).tolist())
            if len(seen) == 2:
                break
        out.put(sorted(seen))
    finally:
        buf.close()


def test_two_processes_share_one_table(daemon):
    ctx = multiprocessing.get_context("spawn")
    out, go = [ctx.Queue(), ctx.Queue()], ctx.Event()
    procs = [ctx.Process(target=_add_and_sample, args=(daemon.socket, float(m), out[m], go)) for m in (0, 1)]
    for p in procs:
        p.start()
    try:
        assert [q.get(timeout=120) for q in out] == ["added", "added"]
        go.set()
        assert [q.get(timeout=120) for q in out] == [[0.0, 1.0], [0.0, 1.0]]  # each samples the other's too
    finally:
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    with daemon.connect() as c:
        assert len(c.table("shared")) == 400
        shared = srb.ReplayBuffer(10_000, OBS, spaces.Discrete(4), socket=daemon.socket, table="shared")
        try:
            with pytest.raises(shmreplay.ReplayError, match="other processes share"):
                shared.reset()
        finally:
            shared.close()
        with pytest.raises(shmreplay.ReplayError, match="leave seed= out"):  # the daemon's own config seeds it
            srb.ReplayBuffer(10_000, OBS, spaces.Discrete(4), socket=daemon.socket, table="shared", seed=1)
        assert len(c.table("shared")) == 400


def test_reset_empties_a_buffer_that_made_its_table():
    buf = srb.ReplayBuffer(100, OBS, spaces.Discrete(4), device="cpu")
    try:
        for step in steps(np.random.default_rng(2), 1, 10):
            buf.add(*step)
        buf.table.flush()
        assert buf.size() == 10
        buf.reset()
        assert buf.size() == 0 and buf.pos == 0 and not buf.full
    finally:
        buf.close()


def test_a_seeded_private_buffer_draws_the_same_transitions_again():
    """``seed=``: the same adds, the same draws (a learning run repeats)."""
    def run(seed):
        obs_space, act = spaces.Box(-1.0, 1.0, (3,), np.float32, seed=5), spaces.Discrete(4, seed=5)
        buf = srb.ReplayBuffer(1000, obs_space, act, device="cpu", seed=seed)
        try:
            for step in steps(np.random.default_rng(3), 1, 50, obs_space, act):
                buf.add(*step)
            return [buf.sample(16).observations.numpy().tobytes() for _ in range(5)]
        finally:
            buf.close()
    first = run(11)
    assert run(11) == first
    assert run(12) != first


@pytest.mark.parametrize("adds, samples", [(1, 1), (16, 4)])
def test_batches_drawn_ahead_lack_nothing_sb3s_loops_added(adds, samples):
    """``ahead=True`` (the default): SAC's loop (an add, a sample) and
    DQN's (a rollout of adds, then a round of samples with none between)
    each draw from everything added so far, once the loop's rhythm is
    known (after its second round: the first interval is not counted):
    every batch of 2,000 draws from at most a few hundred items holds the
    newest one.  Without the dropped early draw of DQN's first batch, the
    newest would be missing every round."""
    act = spaces.Discrete(4)
    buf = srb.ReplayBuffer(10_000, spaces.Box(0.0, 1e6, (1,), np.float32), act, device="cpu", seed=7)
    try:
        n = 0
        for round_ in range(12):
            for _ in range(adds):
                n += 1
                buf.add(np.array([[n]], np.float32), np.array([[n]], np.float32), np.array([0]),
                        np.array([1.0]), np.array([False]), [{}])
            for _ in range(samples):
                newest = buf.sample(2000).observations.max().item()
                assert round_ < 2 or newest == n, (round_, newest, n)
    finally:
        buf.close()
