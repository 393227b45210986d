"""SequenceWriter and NStepWriter against hand-computed items and a plain
reference implementation, through a real daemon."""

import numpy as np
import pytest

import shmreplay
from readback import committed


NSTEP = {"obs": ("float32", (2,)), "action": ("int32", ()), "reward": ("float32", ()),
         "discount": ("float32", ()), "next_obs": ("float32", (2,))}


def test_nstep_writer_matches_hand_computed_transitions(client):
    t = client.create_table("n", 100, NSTEP)
    with shmreplay.NStepWriter(t, n=3, gamma=0.5) as w:
        # episode A: 4 steps, terminated.  obs_k = [k, -k], reward after step k = k + 1
        for k in range(4):
            w.append(obs=[k, -k], action=k, reward=k + 1, next_obs=[k + 1, -(k + 1)],
                     terminated=k == 3)
        # episode B: 2 steps, truncated (time limit): bootstrap, no zero discount
        for k in range(2):
            w.append(obs=[10 + k, 0], action=7, reward=2.0, next_obs=[11 + k, 0], truncated=k == 1)
    t.flush()
    got, _ = committed(t)
    # A: t=0: 1 + .5*2 + .25*3 = 2.75, discount .125, next obs_3; t=1: 2 + 1.5 + 1 = 4.5,
    # ends in termination: discount 0; t=2: 3 + 2 = 5, 0; t=3: 4, 0
    np.testing.assert_allclose(got["reward"], [2.75, 4.5, 5.0, 4.0, 3.0, 2.0])
    np.testing.assert_allclose(got["discount"], [0.125, 0.0, 0.0, 0.0, 0.25, 0.5])
    np.testing.assert_array_equal(got["obs"][:, 0], [0, 1, 2, 3, 10, 11])
    np.testing.assert_array_equal(got["next_obs"][:, 0], [3, 4, 4, 4, 12, 12])
    np.testing.assert_array_equal(got["action"], [0, 1, 2, 3, 7, 7])


def nstep_reference(episodes, n, gamma):
    """Plain n-step transitions: episodes are lists of (obs, action, reward, next_obs)
    with an end flag 'terminated' or 'truncated'."""
    out = []
    for steps, end in episodes:
        for i in range(len(steps)):
            m = min(n, len(steps) - i)
            ret = sum(gamma ** j * steps[i + j][2] for j in range(m))
            term = end == "terminated" and i + m == len(steps)
            out.append((steps[i][0], steps[i][1], ret, 0.0 if term else gamma ** m,
                        steps[i + m - 1][3]))
    return out


def test_nstep_writer_matches_the_reference_on_random_episodes(client):
    t = client.create_table("n", 1000, NSTEP)
    rng = np.random.default_rng(3)
    episodes = []
    for _ in range(12):
        length = int(rng.integers(1, 15))
        obs = rng.normal(size=(length + 1, 2)).astype(np.float32)
        steps = [(obs[i], int(rng.integers(4)), float(rng.normal()), obs[i + 1]) for i in range(length)]
        episodes.append((steps, "terminated" if rng.random() < 0.5 else "truncated"))
    w = shmreplay.NStepWriter(t, n=4, gamma=0.9)
    for steps, end in episodes:
        for i, (o, a, r, o2) in enumerate(steps):
            last = i == len(steps) - 1
            w.append(obs=o, action=a, reward=r, next_obs=o2,
                     terminated=last and end == "terminated", truncated=last and end == "truncated")
    w.close()
    t.flush()
    got, _ = committed(t)
    ref = nstep_reference(episodes, 4, 0.9)
    assert len(got["reward"]) == len(ref)
    for k, (o, a, r, d, o2) in enumerate(ref):
        np.testing.assert_array_equal(got["obs"][k], o)
        assert got["action"][k] == a
        assert got["reward"][k] == pytest.approx(r, rel=1e-5, abs=1e-5)
        assert got["discount"][k] == pytest.approx(d, rel=1e-6)
        np.testing.assert_array_equal(got["next_obs"][k], o2)


def test_nstep_close_mid_episode_returns_the_unfinished_slots(client):
    t = client.create_table("n", 100, NSTEP)
    w = shmreplay.NStepWriter(t, n=3, gamma=0.9)
    for k in range(5):
        w.append(obs=[k, 0], action=0, reward=1.0, next_obs=[k + 1, 0])
    w.close()  # transitions 3 and 4 have no n-th step and no episode end
    t.flush()
    assert len(t) == 3
    assert client.stats()["tables"]["n"]["reserved"] == 0


SEQ = {"obs": ("uint8", (4, 3)), "reward": ("float32", (4,)), "core": ("float32", (2,)),
       "length": ("int32", ())}


def test_sequence_writer_overlaps_pads_episode_ends_and_records_lengths(client):
    t = client.create_table("s", 50, SEQ)
    w = shmreplay.SequenceWriter(t, length=4, period=2,
                                 priority_fn=lambda item: float(item["reward"].sum()))
    for k in range(7):  # sequences start at steps 0, 2, 4, 6
        w.append(obs=np.full(3, k + 1, np.uint8), reward=float(k), core=[k, k])
    w.end_episode()
    w.append(obs=np.full(3, 100, np.uint8), reward=1.0, core=[9, 9])
    w.close()
    t.flush()
    got, prios = committed(t)
    np.testing.assert_array_equal(got["obs"][:, :, 0], [[1, 2, 3, 4], [3, 4, 5, 6], [5, 6, 7, 0],
                                                         [7, 0, 0, 0], [100, 0, 0, 0]])
    np.testing.assert_array_equal(got["length"], [4, 4, 3, 1, 1])
    np.testing.assert_array_equal(got["core"][:, 0], [0, 2, 4, 6, 9], "state at the sequence start")
    np.testing.assert_allclose(prios, [0 + 1 + 2 + 3, 2 + 3 + 4 + 5, 4 + 5 + 6, 6, 1])
    assert np.all(got["reward"][3, 1:] == 0), "padding is zeros, not an old slot's data"


def sequence_reference(episodes, length, period):
    out = []
    for steps in episodes:
        for start in range(0, len(steps), period):
            chunk = steps[start:start + length]
            out.append((np.pad(np.array(chunk), (0, length - len(chunk))), len(chunk)))
    return out


def test_sequence_writer_matches_the_reference_and_reuses_old_slots_cleanly(client):
    fields = {"x": ("int64", (5,)), "length": ("int32", ())}
    t = client.create_table("s", 8, fields)  # small: slots get reused, padding must clear them
    rng = np.random.default_rng(5)
    episodes = [list(rng.integers(1, 1000, size=int(rng.integers(1, 12)))) for _ in range(6)]
    ref = sequence_reference(episodes, 5, 3)
    w = shmreplay.SequenceWriter(t, length=5, period=3)
    for steps in episodes:
        for v in steps:
            w.append(x=v)
        w.end_episode()
    w.close()
    t.flush()
    got, _ = committed(t)
    # every sequence was committed, and the full table keeps the newest 8
    assert len(ref) > 8 and client.stats()["tables"]["s"]["inserts"] == len(ref)
    assert len(got["x"]) == 8
    tail = ref[-8:]
    for k, (x, n) in enumerate(tail):
        np.testing.assert_array_equal(got["x"][k], x)
        assert got["length"][k] == n


def test_writers_refuse_tables_that_do_not_fit(client):
    t = client.create_table("bad", 10, {"x": ("int64", (5,))})
    with pytest.raises(shmreplay.FieldError, match="'length'"):
        shmreplay.SequenceWriter(t, length=5, period=2)
    with pytest.raises(shmreplay.FieldError, match="n-step field"):
        shmreplay.NStepWriter(t, n=3)
    s = client.create_table("s", 10, {"x": ("int64", (5,)), "length": ("int32", ())})
    w = shmreplay.SequenceWriter(s, length=5, period=2)
    with pytest.raises(shmreplay.FieldError, match="step shape"):
        w.append(x=[1, 2])
    with pytest.raises(shmreplay.FieldError, match=r"field 'x': .*ragged list.*give an array of shape \(\)"):
        w.append(x=[[1, 2], [3]])
    w.close()


def test_sequence_writer_on_a_rate_limited_table_waits_for_the_learner(client):
    fields = {"x": ("int64", (4,)), "length": ("int32", ())}
    t = client.create_table("r", 100, fields, samples_per_insert=1.0, error_buffer=(0.0, 3.0))
    w = shmreplay.SequenceWriter(t, length=4, period=4, timeout=0.2)
    for v in range(12):   # 3 sequences: the most the limiter admits
        w.append(x=v)
    with pytest.raises(shmreplay.RateLimited):
        w.append(x=12)   # a 4th sequence would start: held back
    t.sample(2)
    w.append(x=12)
    w.close()
    t.flush()
    assert len(t) == 4


RENAMED = {"observation": ("float32", (2,)), "a": ("int32", ()), "r": ("float32", ()),
           "gamma_t": ("float32", ()), "next_observation": ("float32", (2,)), "step": ("int64", ())}
ROLES = {"obs": "observation", "action": "a", "reward": "r", "discount": "gamma_t",
         "next_obs": "next_observation"}


def test_nstep_writer_takes_the_tables_own_field_names(client):
    t = client.create_table("renamed", 100, RENAMED)
    rng = np.random.default_rng(5)
    obs = rng.normal(size=(7, 2)).astype(np.float32)
    steps = [(obs[i], i % 3, float(i + 1), obs[i + 1]) for i in range(6)]
    with shmreplay.NStepWriter(t, n=3, gamma=0.5, fields=ROLES) as w:
        for i, (o, a, r, o2) in enumerate(steps):
            w.append(obs=o, action=a, reward=r, next_obs=o2, terminated=i == 5, step=i)
    t.flush()
    got, _ = committed(t)
    want = nstep_reference([(steps, "terminated")], 3, 0.5)
    np.testing.assert_array_equal(got["observation"], [s[0] for s in want])
    np.testing.assert_array_equal(got["a"], [s[1] for s in want])
    np.testing.assert_allclose(got["r"], [s[2] for s in want], rtol=1e-6)
    np.testing.assert_allclose(got["gamma_t"], [s[3] for s in want])
    np.testing.assert_array_equal(got["next_observation"], [s[4] for s in want])
    np.testing.assert_array_equal(got["step"], np.arange(6))  # an extra field, from the first step


def test_nstep_writer_field_map_errors_say_what_to_write(client):
    t = client.create_table("renamed", 100, RENAMED)
    with pytest.raises(shmreplay.FieldError, match=r"lacks the n-step field\(s\) obs, .*map the roles"):
        shmreplay.NStepWriter(t, n=3)
    with pytest.raises(shmreplay.FieldError, match=r"unknown writer role\(s\) \['observation'\]"):
        shmreplay.NStepWriter(t, n=3, fields={"observation": "observation"})
    with pytest.raises(shmreplay.FieldError, match="the reward field 'step' must be a scalar float"):
        shmreplay.NStepWriter(t, n=3, fields={**ROLES, "reward": "step"})


def _close_under_a_closed_limiter(path, kind, out):
    """A writer with items open on a table whose rate limiter admits no
    more, closed as a process that is shutting down would."""
    c = shmreplay.connect(path)
    t = c.table(kind)
    if kind == "seq":
        w = shmreplay.SequenceWriter(t, length=4, period=2, timeout=0.2)
        step = dict(x=1)
    else:
        w = shmreplay.NStepWriter(t, n=3, timeout=0.2)
        step = dict(obs=[1, 1], action=1, reward=1.0, next_obs=[1, 1])
    try:
        while True:
            w.append(**step)
    except shmreplay.RateLimited:
        pass
    out.put(len(w.open))
    w.close(timeout=5.0)
    c.close()
    out.put("closed")


@pytest.mark.parametrize("kind", ["seq", "nstep"])
def test_writer_close_never_waits_for_the_rate_limiter(start_daemon, kind):
    import multiprocessing
    d = start_daemon()
    fields = ({"x": ("int64", (4,)), "length": ("int32", ())} if kind == "seq" else NSTEP)
    limits = dict(samples_per_insert=1.0, error_buffer=(0.0, 3.0))
    with d.connect() as c:
        t = c.create_table(kind, 100, fields, **limits)
        ctx = multiprocessing.get_context("fork")  # the child connects by itself: nothing shared
        out = ctx.Queue()
        p = ctx.Process(target=_close_under_a_closed_limiter, args=(d.socket, kind, out))
        p.start()
        try:
            assert out.get(timeout=120) > 0  # items were open when close() was called
            assert out.get(timeout=120) == "closed"
        finally:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
        assert p.exitcode == 0
        c.flush()
        # the limiter admitted 3 items: SequenceWriter commits all 3 (the open
        # ones padded), the n-step writer the one transition that had n steps
        got, _ = committed(t)
        assert len(got["length" if kind == "seq" else "reward"]) == (3 if kind == "seq" else 1)
