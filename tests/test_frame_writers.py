"""Frame tables' writers (docs/frames.md, "What a writer stores"):
``NStepWriter`` and ``SequenceWriter`` store each frame once (over
gymnasium's own ``FrameStackObservation``, both paddings), writer
processes never mix streams while a learner samples, a writer killed
holding frame leases gives them back, and one client's writers share its
leases.  Stacks known from ``framestreams.py``."""

import multiprocessing
import os
import signal

import numpy as np
import pytest

import shmreplay
from framestreams import (DEPTH, check_items, frame, frames_stored, make, stack, tag, transition, untag,
                          write_nstep)
from readback import committed_stacks
from waiting import wait_for


# ---- writers ----
def test_nstep_writer_stores_each_step_once_and_items_hold_their_streams_stacks(daemon, client):
    t = make(client, capacity=400)
    n_items = write_nstep(t, 0, range(6), length=20, n=3)  # its close gives its leases back
    client.flush()
    data, _ = committed_stacks(t)
    assert check_items(data, length=20, n=3) == n_items == 120
    assert frames_stored(daemon, client) == 6 * 21  # per episode: frames 0..20, each once


def test_nstep_writer_over_gymnasiums_frame_stack_both_paddings(client):
    gym = pytest.importorskip("gymnasium")
    from gymnasium.wrappers import FrameStackObservation

    class Pixels(gym.Env):
        observation_space = gym.spaces.Box(0, 255, (8, 8), np.uint8)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return self.np_random.integers(1, 256, (8, 8), dtype=np.uint8), {}

        def step(self, a):
            self.t += 1
            return self.np_random.integers(1, 256, (8, 8), dtype=np.uint8), 1.0, self.t >= 9, False, {}

    for padding in ("reset", "zero"):
        t = make(client, name=f"gym_{padding}", capacity=200)
        env = FrameStackObservation(Pixels(), DEPTH, padding_type=padding)
        truth = {}
        with shmreplay.NStepWriter(t, n=2, gamma=0.5) as w:
            for e in range(5):
                o, _ = env.reset(seed=e)
                for s in range(9):
                    o2, r, term, trunc, _ = env.step(0)
                    w.append(obs=o, action=s, reward=r, next_obs=o2, terminated=term, truncated=trunc,
                             tag=tag(0, e, s))
                    truth[tag(0, e, s)] = o
                    o = o2
        client.flush()
        data, _ = committed_stacks(t)
        assert len(data["tag"]) == 45
        for i, x in enumerate(data["tag"]):
            assert np.array_equal(data["obs"][i], truth[int(x)]), (padding, untag(x))
        stored = frames_stored(None, client, f"gym_{padding}")
        # 10 frames an episode (reset, 9 steps); "zero" adds the zero frame
        assert stored == 5 * 10 + (0 if padding == "reset" else 5), (padding, stored)


def _nstep_writer(path, w, episodes, length):
    with shmreplay.connect(path) as c:
        write_nstep(c.table("px"), w, range(episodes), length)


def test_interleaved_writer_processes_never_mix_streams_while_a_learner_samples(daemon, client):
    """Three writer processes stream into a table smaller than what they
    write, while this process samples: every sampled stack is its item's,
    whole (a frame handed out again during a gather is caught by the stamp)."""
    t = make(client, capacity=128)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_nstep_writer, args=(daemon.socket, w, 8, 30)) for w in range(3)]
    for p in procs:
        p.start()
    checked = 0
    try:
        while any(p.is_alive() for p in procs) or checked == 0:
            if len(t) >= 32:
                checked += check_items(t.sample(32).data, length=30)
    finally:
        for p in procs:
            p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    data, _ = committed_stacks(t)
    assert check_items(data, length=30) == 128
    assert {untag(x)[0] for x in t.sample(128, beta=0.0).data["tag"]} <= {0, 1, 2}


def _hold_frames_then_die(path, ready):
    c = shmreplay.connect(path)
    t = c.table("px")
    for i in range(20):
        t.insert(**transition(i))
    c.flush()
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_holding_frame_leases_gives_them_back(daemon, client):
    t = make(client)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_frames_then_die, args=(daemon.socket, ready))
    p.start()
    p.join(120)
    assert ready.is_set() and p.exitcode == -signal.SIGKILL
    wait_for(lambda: client.stats()["tables"]["px"]["frames"]["in_leases"] == 0,
          "the dead writer's frame leases are given back")
    data, _ = committed_stacks(t)
    assert check_items(data, length=10**6, n=1) == 20
    write_nstep(t, 1, range(2), length=10)  # the table serves on
    client.flush()
    assert len(t) == 40


# ---- sequences (R2D2): overlap stored once ----
SEQ = {"obs": ("uint8", (8, 8, 8)), "action": ("int64", (8,)), "length": ("int32", ()),
       "tag": ("int64", ())}


def _write_sequences(t, w, episodes, steps):
    with shmreplay.SequenceWriter(t, length=8, period=4) as wr:
        for e in range(episodes):
            for s in range(steps):
                wr.append(obs=frame(w, e, s), action=s, tag=tag(w, e, s))
            wr.end_episode()


def test_sequence_writer_stores_each_step_once_however_sequences_overlap(daemon, client):
    t = client.create_table("r2d2", capacity=64, fields=SEQ, frames={"obs": 8}, frames_per_item=4)
    assert t.spec.frames.per_item == 4 and client.table("r2d2").spec == t.spec
    _write_sequences(t, 0, episodes=3, steps=18)
    client.flush()
    data, _ = committed_stacks(t)
    # sequences start every 4 steps of an 18-step episode: at 0, 4, 8, 12, 16
    assert len(data["tag"]) == 15
    for i, x in enumerate(data["tag"]):
        w, e, s0 = untag(x)
        n = min(8, 18 - s0)
        assert data["length"][i] == n
        for k in range(8):
            want = frame(w, e, s0 + k) if k < n else np.zeros((8, 8), np.uint8)
            assert np.array_equal(data["obs"][i, k], want), (e, s0, k)
    # 18 frames an episode, and the zero frame its last two sequences end
    # with: stored at the first, found again at the second; the next
    # episode's is 10+ frames on, out of the writer's window (length + 2)
    assert frames_stored(daemon, client, "r2d2") == 3 * (18 + 1)
    b = t.sample(8)
    assert b.data["obs"].shape == (8, 8, 8, 8)


def test_several_writers_of_one_client_share_its_frame_leases(client):
    """A vector env's streams: four n-step writers of one client, stepped
    in turn (one client may lease half its ring's slack: 625 frames of a
    20,000-item table's), each stream's items whole."""
    t = make(client, capacity=20_000)
    writers = [shmreplay.NStepWriter(t, n=3, gamma=0.5) for _ in range(4)]
    for e in range(2):
        for s in range(30):
            for w, wr in enumerate(writers):
                wr.append(obs=stack(w, e, s), action=s, reward=float(s), next_obs=stack(w, e, s + 1),
                          terminated=s == 29, tag=tag(w, e, s))
    for wr in writers:
        wr.close()
    client.flush()
    data, _ = committed_stacks(t)
    assert check_items(data, length=30) == 4 * 2 * 30
