"""Issue 13, item 5: two table promises that tests/test_table.py checks on an
in-process ``Table``, checked again in a real daemon process.

* Sum-tree drift is detected by the periodic check and the tree rebuilt from
  the segment's priorities.  The tree is the daemon's private memory, so the
  damage is injected into a real daemon (``drifting_daemon.py``), the way
  ``crashing_daemon.py`` injects an engine failure.
* A blocked sample takes nothing: a SAMPLE that the table holds back, parked
  and retried by the engine until its timeout, removes no item, counts no
  sample, holds no slot and moves no limiter counter, in the daemon's stats
  and in the table segment alike."""

import multiprocessing as mp
import os
import sys

import numpy as np
import pytest

import shmreplay
from faults import FIELDS, HANG_S, reap, rows, table_state, wait_for
from shmreplay.wire.layout import TableMap

HERE = os.path.dirname(os.path.abspath(__file__))
CTX = mp.get_context("fork")

# capacity 8 is a tree of 8 leaves: node 3 sums slots 4..7, and updates of
# slots 0..3 recompute only nodes 2 and 1, so they leave that damage in place
DRIFTING = {"name": "per", "capacity": 8, "sampler": "prioritized", "alpha": 0.5, "fields": FIELDS}
DRAWS = 128


def probabilities(prios: np.ndarray) -> np.ndarray:
    """P(i) = p_i ** alpha / sum_j p_j ** alpha over a table's items."""
    values = prios ** DRIFTING["alpha"]
    return values / values.sum()


def test_sum_tree_drift_is_detected_and_rebuilt_from_the_segment(start_daemon, tmp_path):
    """A sum tree damaged in the daemon's memory is found by the check that
    runs every ``capacity`` leaf writes and rebuilt from the priorities in
    the segment: the probabilities clients get are exact again."""
    drift = tmp_path / "drift-now"
    d = start_daemon(tables=[DRIFTING], command=[sys.executable, os.path.join(HERE, "drifting_daemon.py")],
                     env={"SHMREPLAY_TEST_DRIFT_FILE": str(drift)})
    # squares: the tree values are the integers 1..8, so every sum in the
    # tree is exact and the probabilities can be compared bit for bit
    prio = (np.arange(8) + 1.0) ** 2  # item id i has priority prio[i]
    with d.connect() as c:
        t = c.table("per")
        t.insert_batch(rows(np.arange(8)), priorities=prio)
        c.flush()  # 8 leaf writes: one check, of a sound tree
        assert c.stats()["tables"]["per"]["tree_rebuilds"] == 0
        # stratified draws, one per 1/128 of the mass: an item of at least
        # 2/128 of it is always drawn, and the smallest here has 1/36 (1/66 later)
        b = t.sample(DRAWS)
        assert sorted(set(b.data["id"].tolist())) == list(range(8))
        np.testing.assert_array_equal(b.probabilities, probabilities(prio)[b.data["id"]])

        drift.touch()
        c.stats()  # returns once the tree is damaged (drifting_daemon.py)
        b = t.sample(DRAWS)
        assert not np.array_equal(b.probabilities, probabilities(prio)[b.data["id"]]), \
            "the injected damage did not reach the probabilities"
        assert c.stats()["tables"]["per"]["tree_rebuilds"] == 0  # sampling writes no leaf

        # 8 leaf writes, all in slots 0..3 (new priorities there), trigger
        # the next check; none of them repairs node 3
        left = np.unique(b.keys[b.indices < 4])
        assert left.shape[0] == 4, "slots 0..3 hold items, each drawn"
        id_of = dict(zip(b.keys.tolist(), b.data["id"].tolist()))
        prio[[id_of[k] for k in left.tolist()]] = 100.0
        t.update_priorities(np.concatenate([left, left]), np.full(8, 100.0))
        c.flush()
        st = c.stats()["tables"]["per"]
        assert st["priority_updates"] == 8 and st["tree_rebuilds"] == 1, st

        b = t.sample(DRAWS)
        assert sorted(set(b.data["id"].tolist())) == list(range(8))
        np.testing.assert_array_equal(b.probabilities, probabilities(prio)[b.data["id"]])
        assert c.stats()["tables"]["per"]["tree_rebuilds"] == 1


# A queue (client.create_queue: fifo, each item sampled once, one sample per
# insert) holds 3 items and is asked for 8: the rate limiter holds the
# sample back before anything is drawn.  A prioritized table whose items are
# sampled once holds 4 items, 2 of priority 0, and is asked for 3: the limits
# admit it (4 uses left, positive mass), the draw takes the 2 positive
# items out of the sum tree and then runs dry, so it must put them back.
BLOCKED = {
    "queue": dict(table={"name": "q", "capacity": 16, "sampler": "fifo", "remover": "fifo",
                         "max_times_sampled": 1, "samples_per_insert": 1.0,
                         "error_buffer": [0.0, 16.0], "fields": FIELDS},
                  prios=[1.0, 1.0, 1.0], ask=8, why="below min_diff",
                  then=[0, 1, 2]),  # in insertion order: every item, once
    "zero priority": dict(table={"name": "z", "capacity": 16, "sampler": "prioritized",
                                 "max_times_sampled": 1, "fields": FIELDS},
                          prios=[1.0, 1.0, 0.0, 0.0], ask=3, why="zero priority",
                          then=[0, 1]),  # the two that can be drawn, once each
}
WAIT_S = 2.0  # how long the blocked sample waits: the test takes that long, no assert depends on it


def untouched(c, segment: str, name: str) -> dict:
    """What a blocked sample must leave as it was: the table's counters in
    the daemon's stats, and per slot its state, stamp, priority and times
    sampled plus every live word, in the segment."""
    st = c.stats()["tables"][name]
    tm = TableMap.attach(segment)
    try:
        w = tm.words
        seg = {"state": tm.state.copy(),
               "words": [w.size, w.inserts, w.pending, w.samples, w.deletes, w.free, w.uses, w.mass]}
    finally:
        tm.release()
    lim = st["limiter"]  # less waiting_samples: that one is meant to move
    return {**{k: st[k] for k in ("size", "samples", "sample_calls", "held", "reserved",
                                  "removed_after_max_samples", "evictions")},
            **{f"limiter.{k}": lim[k] for k in ("inserts", "samples", "deletes", "pending", "uses_left")},
            **seg, **table_state(segment)}


def assert_untouched(now: dict, before: dict, when: str) -> None:
    assert now.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(now[k], before[k], err_msg=f"{k} {when}")


def blocked_learner(sock, table, n, timeout, out):
    """Sample n items, waiting at most ``timeout``; report the ids or the error."""
    with shmreplay.connect(sock, timeout=30) as c:
        try:
            out.put(("batch", c.table(table).sample(n, timeout=timeout).data["id"].tolist()))
        except shmreplay.ReplayError as exc:
            out.put((type(exc).__name__, str(exc)))


@pytest.mark.parametrize("case", list(BLOCKED))
def test_a_blocked_sample_takes_nothing(start_daemon, case):
    """A SAMPLE the table holds back is parked and retried by the engine
    until its timeout, then answered RateLimited; meanwhile and after, no
    item left the table, none counts a sample, no slot is held and no
    limiter counter moved; the items are then sampled as if it never was."""
    spec = BLOCKED[case]
    name = spec["table"]["name"]
    d = start_daemon(tables=[spec["table"]])
    segment = f"/shmreplay.{d.instance}.t.{name}"
    with d.connect() as c:
        t = c.table(name)
        t.insert_batch(rows(np.arange(len(spec["prios"]))), priorities=spec["prios"])
        c.flush()
        before = untouched(c, segment, name)
        assert before["size"] == len(spec["prios"]) and before["held"] == 0
        out = CTX.Queue()
        p = CTX.Process(target=blocked_learner, args=(d.socket, name, spec["ask"], WAIT_S, out))
        p.start()
        try:
            # sample_waits counts parkings ever made: the wait cannot miss a
            # park that a loaded box let end before the first poll
            wait_for(lambda: c.stats()["tables"][name]["sample_waits"] >= 1, "the sample to park")
            # each stats call wakes the engine, and every pass of the engine
            # retries the parked sample: it has been refused again by now
            assert_untouched(untouched(c, segment, name), before, "while the sample is parked")
            got = out.get(timeout=HANG_S)
            p.join(HANG_S)
        finally:
            reap([p])
        assert got[0] == "RateLimited" and "timed out" in got[1] and spec["why"] in got[1], got
        assert_untouched(untouched(c, segment, name), before, "after the sample timed out")
        st = c.stats()["tables"][name]
        assert st["timeouts"] >= 1 and st["limiter"]["waiting_samples"] == 0, st
        b = t.sample(len(spec["then"]), timeout=0)  # runs at once: nothing is missing
        ids = b.data["id"].tolist()
        assert (ids if case == "queue" else sorted(ids)) == spec["then"]
