"""Issue 13, item 5: sum-tree drift in a real daemon process.  The damage
that ``tests/test_table.py`` injects into an in-process ``Table`` is
injected here into a real daemon's private memory (``drifting_daemon.py``,
the way ``crashing_daemon.py`` injects an engine failure): the periodic
check finds it and rebuilds the tree from the segment's priorities, and
the probabilities clients get are exact again."""

import os
import sys

import numpy as np

from faults import FIELDS, rows

HERE = os.path.dirname(os.path.abspath(__file__))

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
