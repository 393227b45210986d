"""Pixel streams for frame-table tests, known without the code under test:
frame ``(w, e, t)`` (writer, episode, step) is bytes drawn from a generator
seeded by those three numbers, so any process can rebuild any stack a
learner samples from its item's ``tag``.

* ``frame(w, e, t)``: one 8x8 uint8 frame (a step's new frame);
* ``stack(w, e, t)``: the stacked observation at step t, as gymnasium's
  ``FrameStackObservation`` (``padding_type="reset"``) makes it: frames
  t-3..t, the episode's first frame standing in for steps before it;
* ``tag(w, e, t)`` and ``untag``: an item's stream position as one int64;
* ``make``, ``transition``, ``stacked``, ``fresh``: a frame table of these
  fields, one stream's plain transitions, items as a batch, stacks no
  stream shares; ``frames_stored``: the frames a table's items hold once
  its writers gave their leases back;
* ``write_nstep(table, w, episodes, length, n)``: an ``NStepWriter`` over
  such a stream, rewards the step numbers, episodes of ``length`` steps
  that terminate; ``expected_next(w, e, t, length, n)``: the next_obs an
  item starting at t must hold.
"""

import numpy as np

from waiting import wait_for

FRAME, DEPTH = (8, 8), 4
FIELDS = {"obs": ("uint8", (DEPTH, *FRAME)), "next_obs": ("uint8", (DEPTH, *FRAME)),
          "action": ("int64", ()), "reward": ("float32", ()), "discount": ("float32", ()),
          "tag": ("int64", ())}
FRAMES = {"obs": DEPTH, "next_obs": "obs"}


def frame(w: int, e: int, t: int) -> np.ndarray:
    return np.random.default_rng([w, e, t]).integers(0, 256, FRAME, dtype=np.uint8)


def stack(w: int, e: int, t: int) -> np.ndarray:
    return np.stack([frame(w, e, max(0, s)) for s in range(t - DEPTH + 1, t + 1)])


def tag(w: int, e: int, t: int) -> int:
    return (w * 1000 + e) * 1000 + t


def untag(x: int) -> tuple[int, int, int]:
    x = int(x)
    return x // 1_000_000, x // 1000 % 1000, x % 1000


def expected_next(w: int, e: int, t: int, length: int, n: int) -> np.ndarray:
    return stack(w, e, min(t + n, length))


def write_nstep(table, w: int, episodes: range, length: int, n: int = 3) -> int:
    """Write the episodes through an ``NStepWriter``; returns the items
    committed (every step of an episode that terminates makes one)."""
    import shmreplay
    with shmreplay.NStepWriter(table, n=n, gamma=0.5) as wr:
        for e in episodes:
            for t in range(length):
                wr.append(obs=stack(w, e, t), action=t, reward=float(t), next_obs=stack(w, e, t + 1),
                          terminated=t == length - 1, tag=tag(w, e, t))
    return len(episodes) * length


def check_items(data: dict, length: int, n: int = 3) -> int:
    """Every item in ``data`` (a batch's or ``readback``'s arrays) holds the
    stacks its tag says; returns how many were checked."""
    for i, x in enumerate(data["tag"]):
        w, e, t = untag(x)
        assert np.array_equal(data["obs"][i], stack(w, e, t)), (w, e, t, "obs")
        assert np.array_equal(data["next_obs"][i], expected_next(w, e, t, length, n)), (w, e, t)
        assert data["action"][i] == t
    return len(data["tag"])


def make(client, name="px", capacity=256, **kw):
    return client.create_table(name, capacity=capacity, fields=FIELDS, frames=FRAMES, **kw)


def transition(i: int) -> dict:
    """Transition i of one stream of 0 .. as a plain insert gives it."""
    return {"obs": stack(0, 0, i), "next_obs": stack(0, 0, i + 1), "action": i, "reward": float(i),
            "discount": 0.5, "tag": tag(0, 0, i)}


def stacked(items: list[dict]) -> dict:
    return {k: np.stack([np.asarray(it[k]) for it in items]) for k in items[0]}


def frames_stored(daemon, client, name="px") -> int:
    """Frames the table's items hold: those held once no writer holds a
    lease (call it when the writers have closed their clients)."""
    wait_for(lambda: client.stats()["tables"][name]["frames"]["in_leases"] == 0,
             "the writers' frame leases are given back")
    return client.stats()["tables"][name]["frames"]["rings"]["obs"]["held"]


def fresh(i: int):
    """Stacks of eight frames no stream shares, known from ``i``."""
    rng = np.random.default_rng([99, i])
    return (rng.integers(0, 256, (DEPTH, 8, 8), dtype=np.uint8),
            rng.integers(0, 256, (DEPTH, 8, 8), dtype=np.uint8))
