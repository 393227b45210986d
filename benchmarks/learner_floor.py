#!/usr/bin/env python3
"""The floor of a learner's sample + update on this machine (issue 22).

    python3 benchmarks/learner_floor.py [--workload sac-mujoco] [--rounds 15]

The work one prioritized sample + update must do, in one process, with no
daemon, no command ring and no Python around it: the daemon's draw kernel
(``sumtree.tree_draw``: 256 stratified draws from a tree of the table's
capacity, probabilities and weights), the learner's gather of those rows
from a table segment in /dev/shm in the layout the table gets
(``row_layout="auto"``: the client's ``rowcopy.take_slot_rows`` for rows
of at most 4 KiB, ``np.take`` per field above; the other layout too, for
comparison), and the daemon's tree update for the batch
(``sumtree.tree_update``).
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
from shmreplay.client import rowcopy
from shmreplay.schema import make_spec
from shmreplay.server.tables.select import sumtree
from shmreplay.wire.headers import ROWS_OFF
from shmreplay.wire.layout import TableMap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="sac-mujoco", choices=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    w = WORKLOADS[a.workload]
    n, b = w.capacity, w.batch
    spec = make_spec("floor", n, w.fields, sampler="prioritized", alpha=0.6)
    other = "field" if spec.row_layout == "slot" else "slot"
    maps = {lay: TableMap.create(f"/shmreplay.floor{os.getpid()}.t.{lay}",
                                 make_spec("floor", n, w.fields, sampler="prioritized", alpha=0.6, row_layout=lay))
            for lay in ("slot", "field")}
    try:
        for tm in maps.values():
            for f in tm.fields.values():
                f[...] = 1  # every page touched once, as a filled table's are
        rng = np.random.default_rng(0)
        sums, mins = sumtree.new_trees(n)
        sumtree.tree_rebuild(sums, mins, rng.random(n) + 0.1)
        fields = spec.fields
        slots, probs, weights = np.empty(b, np.int64), np.empty(b), np.empty(b)
        prios = rng.random(b) + 0.1
        gathers = {lay: _gather(maps[lay], fields, slots, b) for lay in maps}

        def draw():
            sumtree.tree_draw(sums, mins, rng.random(b), 0.4, slots, probs, weights)

        gather = gathers[spec.row_layout]

        def update():
            sumtree.tree_update(sums, mins, slots, prios)

        def all_three():
            draw()
            gather()
            update()

        cells = {"draw": draw, f"gather, {spec.row_layout} (same rows)": gather,
                 f"gather, {other} (same rows)": gathers[other], "update (same leaves)": update,
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
        for tm in maps.values():
            tm.unlink()
            tm.release()
    return 0


def _gather(tm, fields, slots, b):
    """The client's copy of ``slots``' rows in ``tm``'s layout (draws.py's
    ``take_rows`` without the batch around it)."""
    out = {f.name: np.empty((b, *f.shape), f.dtype) for f in fields}
    lo = tm.layout
    if lo.row_stride:
        src = np.ndarray((lo.spec.capacity, lo.row_stride), np.uint8, tm.rows.buf, ROWS_OFF)
        offs = np.array([lo.field_offs[f.name] - ROWS_OFF for f in fields], np.int64)
        widths = np.array([f.item_bytes for f in fields], np.int64)
        addrs = np.array([out[f.name].ctypes.data for f in fields], np.int64)
        rows = np.arange(b)
        # ``out`` rides along: the kernel writes through its addresses, so
        # the arrays must outlive this call (they did not, and it crashed)
        return lambda out=out: rowcopy.take_slot_rows(src, slots.view(np.uint64), rows, offs, widths, addrs, b)

    def by_field():
        for f in fields:
            np.take(tm.fields[f.name], slots, axis=0, out=out[f.name], mode="clip")
    return by_field


if __name__ == "__main__":
    sys.exit(main())
