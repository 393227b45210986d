"""A real shmreplayd whose sum trees drift on demand (fault injection for
tests/fault/test_tree_drift.py): once the file named by
$SHMREPLAY_TEST_DRIFT_FILE exists, the engine's next stats snapshot first
corrupts the sum tree of every prioritized table, once, as a stray write
would: an inner node over the right half of the leaves and the root gain
0.5 together, so the tree stays consistent along every path the left half's
updates recompute, and only the periodic check can see the damage.

The tree lives in the daemon's private memory, so no client can reach it;
the stats call is the hook because it runs on the engine thread (the only
one that may touch a table) and returns after the damage is done, so the
test knows the order without any clock."""

import os
import sys

# the repository's package, not an installed copy (this file runs as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shmreplay.server import daemon  # noqa: E402

from shmreplay.server.engine import engine  # noqa: E402

_snapshot = engine.Engine.snapshot
_done = []


def _drift_then_snapshot(self):
    if not _done and os.path.exists(os.environ["SHMREPLAY_TEST_DRIFT_FILE"]):
        _done.append(True)
        for t in self.tables.values():
            if t.spec.sampler == "prioritized":
                t.selection.sampler.sums[3] += 0.5  # the right half's inner node...
                t.selection.sampler.sums[1] += 0.5  # ...and a root consistent with it
    return _snapshot(self)


engine.Engine.snapshot = _drift_then_snapshot

if __name__ == "__main__":
    sys.exit(daemon.main())
