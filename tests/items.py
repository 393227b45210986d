"""Items for tests against a real daemon, and quick looks at a table.

* ``F``: a table of one int64 field ``v``; ``insert_ids`` inserts the items
  ``lo..hi-1`` (each item's ``v`` is its id), ``ids`` reads a batch's ids;
* ``good_row(i)``: a row of conftest's ``SMALL_FIELDS`` whose every field
  follows from ``i``; ``TABLE``: a table of that shape as a daemon's config
  declares it;
* ``table_stats``: one table's stats, one consistent snapshot;
* ``assert_still_serving``: table ``"t"`` still takes an insert and serves
  a sample (after something was refused).
"""

import numpy as np

F = {"v": ("int64", ())}


def ids(batch):
    return batch.data["v"].tolist()


def insert_ids(t, lo, hi):
    t.insert_batch({"v": np.arange(lo, hi)})
    t.flush()


def table_stats(client, name):
    return client.stats()["tables"][name]  # one consistent snapshot


def good_row(i=0):
    return {"obs": np.full((4, 8, 8), i % 256, np.uint8), "action": i, "reward": float(i)}


TABLE = {"name": "cfg", "capacity": 100, "sampler": "uniform", "alpha": 0.6,
         "fields": {"obs": ("uint8", (4, 8, 8)), "action": ("int64", ()), "reward": ("float32", ())}}


def assert_still_serving(daemon, n_before=None):
    with daemon.connect() as c:
        t = c.table("t")
        if n_before is not None:
            assert len(t) == n_before
        t.insert(**good_row(7))
        t.flush()
        assert len(t.sample(4)) == 4
