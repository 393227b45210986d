"""``client/framestream.py``: which frames of a stacked observation a writer
stores.  Stacks come from gymnasium's own ``FrameStackObservation`` over a
small pixel env, with both paddings; a list stands for the frame ring.
Every stack rebuilt from its references is the one given, byte for byte;
the frames stored are counted against what the stream holds."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.wrappers import FrameStackObservation
from hypothesis import given, settings
from hypothesis import strategies as st

from shmreplay.client.framestream import FrameWindow, frame_checksum

FRAME = (6, 5)


def fnv_twin(b: bytes) -> int:
    """FNV-1a over little-endian 8-byte words, then the tail's bytes."""
    h, mask = 0xCBF29CE484222325, 2**64 - 1
    n8 = len(b) // 8
    for i in range(n8):
        h = ((h ^ int.from_bytes(b[8 * i:8 * i + 8], "little")) * 0x100000001B3) & mask
    for x in b[8 * n8:]:
        h = ((h ^ x) * 0x100000001B3) & mask
    return h


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=70))
def test_the_checksum_is_its_twin_bit_for_bit(b):
    assert int(frame_checksum(np.frombuffer(b, dtype=np.uint8).copy())) == fnv_twin(b)


class PixelEnv(gym.Env):
    """Frames of random pixels; an episode ends after ``length`` steps."""

    observation_space = gym.spaces.Box(0, 255, FRAME, np.uint8)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int):
        self.length, self.t = length, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.integers(0, 256, FRAME, dtype=np.uint8), {}

    def step(self, action):
        self.t += 1
        obs = self.np_random.integers(0, 256, FRAME, dtype=np.uint8)
        return obs, 0.0, self.t >= self.length, False, {}


class Ring:
    """A list standing for a frame ring."""

    def __init__(self):
        self.frames = []

    def store(self, frame):
        self.frames.append(np.array(frame, copy=True))
        return len(self.frames) - 1

    def fetch(self, ref):
        return self.frames[ref]

    def stack(self, refs):
        return np.stack([self.frames[r] for r in refs])


def run_episodes(padding, episodes, length, window=8):
    env = FrameStackObservation(PixelEnv(length), 4, padding_type=padding)
    ring, win = Ring(), FrameWindow(window)
    stacks = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=ep)
        done = False
        while True:
            refs = win.refs(obs, ring.store, ring.fetch)
            assert ring.stack(refs).tobytes() == np.asarray(obs).tobytes()
            stacks.append(refs)
            if done:
                break
            obs, _, term, trunc, _ = env.step(0)
            done = term or trunc
    return ring, stacks


@pytest.mark.parametrize("padding, per_episode", [("reset", 0), ("zero", 1)])
def test_a_stream_stores_one_frame_a_step_and_its_padding_once(padding, per_episode):
    length = 9
    ring, stacks = run_episodes(padding, episodes=3, length=length)
    # each episode: its first frame, then one a step (length more), and for
    # "zero" the zero frame; after the first episode the zero frame is
    # still in the window only if the window reaches back that far (8: no)
    assert len(ring.frames) == 3 * (1 + length + per_episode)
    first = stacks[0]
    if padding == "reset":
        assert len(set(first.tolist())) == 1  # the first frame, referenced four times
    else:
        assert len(set(first[:3].tolist())) == 1 and not ring.fetch(first[0]).any()


def test_a_plain_insert_of_obs_and_next_obs_stores_one_frame_a_transition():
    env = FrameStackObservation(PixelEnv(50), 4)
    ring, win = Ring(), FrameWindow(8)
    obs, _ = env.reset(seed=3)
    for _ in range(20):
        nxt, *_ = env.step(0)
        for stack in (obs, nxt):  # what t.insert(obs=obs, next_obs=nxt) hands the window
            assert ring.stack(win.refs(stack, ring.store, ring.fetch)).tobytes() == stack.tobytes()
        obs = nxt
    assert len(ring.frames) == 1 + 20


def test_n_step_next_obs_ahead_of_obs_is_found_in_a_window_that_reaches_it():
    env = FrameStackObservation(PixelEnv(100), 4)
    obs, _ = env.reset(seed=4)
    seen = [obs]
    for _ in range(40):
        seen.append(env.step(0)[0])
    n = 3
    for size, most in ((4 + n + 1, 1 + 40), (2, None)):
        ring, win = Ring(), FrameWindow(size)
        for t in range(len(seen) - n):  # the n-step item (obs_t, next_obs_t+n), in order
            for stack in (seen[t], seen[t + n]):
                assert ring.stack(win.refs(stack, ring.store, ring.fetch)).tobytes() == stack.tobytes()
        if most is not None:
            assert len(ring.frames) == most
        else:  # a window too short stores frames again: more, never wrong
            assert len(ring.frames) > 1 + 40


def test_forgotten_frames_are_never_referenced_again():
    ring, win = Ring(), FrameWindow(16)
    stack = np.arange(2 * 30, dtype=np.uint8).reshape(2, 6, 5)
    refs = win.refs(stack, ring.store, ring.fetch)
    assert (win.refs(stack, ring.store, ring.fetch) == refs).all() and len(ring.frames) == 2
    win.forget(refs[:1])
    again = win.refs(stack, ring.store, ring.fetch)
    assert again[0] == 2 and again[1] == refs[1] and len(ring.frames) == 3


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 10), steps=st.integers(1, 30))
def test_stacks_of_few_distinct_frames_rebuild_exactly_and_store_only_misses(seed, size, steps):
    """Frames from an alphabet of 5 (many equal): a plain model of the
    window (the last ``size`` stored, oldest dropped first) says which
    frames must be stored."""
    rng = np.random.default_rng(seed)
    alphabet = rng.integers(0, 3, size=(5, *FRAME), dtype=np.uint8)
    ring, win = Ring(), FrameWindow(size)
    model: list[int] = []  # alphabet letters of the frames the window holds, oldest first
    stored = 0
    forgotten = set()
    for _ in range(steps):
        letters = rng.integers(0, 5, size=4)
        for x in letters:  # the model, frame by frame as the window goes
            if not any((alphabet[y] == alphabet[x]).all() for y in model):
                stored += 1
                model = (model + [int(x)])[-size:]
        stack = alphabet[letters]
        assert ring.stack(win.refs(stack, ring.store, ring.fetch)).tobytes() == stack.tobytes()
        newest = len(ring.frames) - 1
        if rng.random() < 0.2 and newest not in forgotten:
            win.forget([newest])  # the newest stored frame's lease goes back
            forgotten.add(newest)
            model = model[:-1]
    assert len(ring.frames) == stored
