#!/usr/bin/env python3
"""The floor of a learner's sample + update on this machine (issue 22).

    python3 benchmarks/learner_floor.py [--workload sac-mujoco] [--rounds 15]

The work one prioritized sample + update must do, in one process, with no
daemon, no command ring and no Python around it: the daemon's draw kernel
(``sumtree.tree_draw``: 256 stratified draws from a tree of the table's
capacity, probabilities and weights), the learner's gather of those rows
from a table segment in /dev/shm (``np.take`` per field, as the client
does), and the daemon's tree update for the batch (``sumtree.tree_update``).
Each part alone repeats one batch (its rows and leaves stay in cache); the
last cell runs the three in sequence on fresh draws, which is what a
learner pays.  Prints medians and minima over interleaved rounds, in µs.
No end-to-end figure can beat the last cell.  Not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from shmreplay.bench.workloads import WORKLOADS
from shmreplay.schema import make_spec
from shmreplay.server.tables.select import sumtree
from shmreplay.wire.layout import TableMap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="sac-mujoco", choices=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    w = WORKLOADS[a.workload]
    n, b = w.capacity, w.batch
    spec = make_spec("floor", n, w.fields, sampler="prioritized", alpha=0.6)
    tm = TableMap.create(f"/shmreplay.floor{os.getpid()}.t", spec)
    try:
        for f in tm.fields.values():
            f[...] = 1  # every page touched once, as a filled table's are
        rng = np.random.default_rng(0)
        sums, mins = sumtree.new_trees(n)
        sumtree.tree_rebuild(sums, mins, rng.random(n) + 0.1)
        out = {k: np.empty((b,) + v.shape[1:], v.dtype) for k, v in tm.fields.items()}
        slots, probs, weights = np.empty(b, np.int64), np.empty(b), np.empty(b)
        prios = rng.random(b) + 0.1

        def draw():
            sumtree.tree_draw(sums, mins, rng.random(b), 0.4, slots, probs, weights)

        def gather():
            for k, v in tm.fields.items():
                np.take(v, slots, axis=0, out=out[k], mode="clip")

        def update():
            sumtree.tree_update(sums, mins, slots, prios)

        def all_three():
            draw()
            gather()
            update()

        cells = {"draw": draw, "gather (same rows)": gather, "update (same leaves)": update,
                 "draw + gather + update": all_three}
        res: dict = {k: [] for k in cells}
        for _ in range(a.rounds):
            for k, fn in cells.items():
                reps = 200
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                res[k].append((time.perf_counter() - t0) / reps * 1e6)
        print(f"{a.workload}: {n:,} items, batch {b}; µs per call over {a.rounds} rounds")
        for k, v in res.items():
            print(f"  {k:<24} median {np.median(v):7.1f}   min {min(v):7.1f}")
    finally:
        tm.unlink()
        tm.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
