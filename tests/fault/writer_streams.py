"""The rows each actor's stream in ``test_writer_restart.py`` must produce.

Every value derives from ``id = actor << 40 | global step`` and the
actor's fixed episode length, so a row mixing two writes (or a transition
built from another n than the episode allowed) shows up wherever it is
read: ``torn_mask`` names every such row.
"""

from __future__ import annotations

import numpy as np

N, GAMMA, D = 5, 0.9, 4            # n-step transitions of D-wide int observations
SEQ_LEN, PERIOD = 8, 4             # sequences overlap by half
EP_LEN = {1: 23, 2: 17, 3: 29, 4: 21, 5: 19}   # episode length of each actor
KIND = {1: "nstep", 2: "nstep", 3: "plain", 4: "seq", 5: "seq"}
STALLED = 2                        # holds open transitions across the restart, resumes late
NSTEP_ACTORS = (1, 2, 3)
SEQ_ACTORS = (4, 5)
NSTEP_FIELDS = {"obs": ("int64", (D,)), "next_obs": ("int64", (D,)), "action": ("int64", ()),
                "reward": ("float64", ()), "discount": ("float64", ()), "id": ("int64", ())}
SEQ_FIELDS = {"step": ("int64", (SEQ_LEN,)), "r": ("float32", (SEQ_LEN,)), "id": ("int64", ()),
              "length": ("int32", ())}
MASK40 = (1 << 40) - 1
_EP = np.ones(8, np.int64)
for _a, _n in EP_LEN.items():
    _EP[_a] = _n


def step_ids(a: int, g) -> np.ndarray:
    return (np.int64(a) << np.int64(40)) | np.asarray(g, np.int64)


def obs_of(ids) -> np.ndarray:
    """The observation at the step an id names (next_obs of step g is obs_of(id + 1))."""
    return np.asarray(ids, np.int64)[..., None] * D + np.arange(D, dtype=np.int64)


def reward_of(g):
    return 1.0 + (np.asarray(g) % 5) * 0.25


def action_of(g):
    return (np.asarray(g) * 7 + 3) % 11


def _split(ids: np.ndarray, actors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(known actor?, step, episode length); unknown ids get a harmless stand-in."""
    a = ids >> 40
    known = (ids >= 0) & np.isin(a, actors)
    g = np.where(known, ids & MASK40, 0)
    return known, g, _EP[np.where(known, a, 0)]


def nstep_rows(ids) -> dict:
    """The transition starting at each id's step: m = min(n, steps left in
    the episode), reward = sum gamma^j r_{t+j} over j < m, discount 0 if the
    episode terminated within those m steps (even episodes terminate, odd
    ones are truncated), else gamma^m; next_obs = the observation after m steps."""
    ids = np.asarray(ids, np.int64)
    _, g, ep = _split(ids, NSTEP_ACTORS)
    k = g % ep
    m = np.minimum(N, ep - k)
    ret = np.zeros(ids.shape)
    for j in range(N):  # the order the writer adds them in
        ret += np.where(j < m, GAMMA ** j * reward_of(g + j), 0.0)
    term = ((g // ep) % 2 == 0) & (k + m == ep)
    return {"obs": obs_of(ids), "next_obs": obs_of(ids + m), "action": action_of(g),
            "reward": ret, "discount": np.where(term, 0.0, GAMMA ** m), "id": ids}


def seq_rows(ids) -> tuple[dict, np.ndarray]:
    """The sequence starting at each id's step, and whether such a sequence
    can exist (it starts a multiple of PERIOD into its episode)."""
    ids = np.asarray(ids, np.int64)
    _, g, ep = _split(ids, SEQ_ACTORS)
    k = g % ep
    n = np.minimum(SEQ_LEN, ep - k)
    j = np.arange(SEQ_LEN)
    real = j < n[:, None]
    rows = {"step": np.where(real, ids[:, None] + j, 0),
            "r": np.where(real, reward_of(g[:, None] + j), 0.0).astype(np.float32),
            "id": ids, "length": n}
    return rows, k % PERIOD == 0


def torn_mask(table: str, data: dict) -> np.ndarray:
    """True for every row that is not exactly what its id says."""
    ids = data["id"]
    if table == "nstep":
        known = _split(ids, NSTEP_ACTORS)[0]
        want = nstep_rows(ids)
        ok = (known & np.all(data["obs"] == want["obs"], axis=1)
              & np.all(data["next_obs"] == want["next_obs"], axis=1)
              & (data["action"] == want["action"])
              & np.isclose(data["reward"], want["reward"], rtol=1e-12, atol=0)
              & np.isclose(data["discount"], want["discount"], rtol=1e-12, atol=0))
    else:
        known = _split(ids, SEQ_ACTORS)[0]
        want, can = seq_rows(ids)
        ok = (known & can & np.all(data["step"] == want["step"], axis=1)
              & np.all(data["r"] == want["r"], axis=1) & (data["length"] == want["length"]))
    return ~ok


def steps_to_mid_episode(g: int, ep: int, steps_in: int = 3) -> int:
    """Steps to append from global step g so that the episode is >= steps_in
    steps old and not over: an n-step writer then has open transitions."""
    s = 1
    while not steps_in - 1 <= (g + s - 1) % ep <= ep - 2:
        s += 1
    return s


def steps_to_episode_end(g: int, ep: int) -> int:
    return ep - g % ep
