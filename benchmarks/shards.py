#!/usr/bin/env python3
"""A table sharded over 1, 2 and 3 nodes' daemons against one table and Ray's own transfer (issue 39, item 6).

    python3 benchmarks/shards.py [--shards 1 2 3] [--batches 150] [--rounds 3] [--workloads sac-mujoco dqn-atari]

Starts a three-node Ray cluster on 127.0.0.1 (``ray start --block``: the
head, where the learner runs, and two more), a shard daemon on each
(``shmreplay.ray.start_shards``), and per workload fills a prioritized
table of ``--items`` items a shard (rows written on each shard's own node),
then, per shard count N (the head's shard first), in one run:

* ``sharded``: the learner draws ``--batches`` batches over the first N
  shards (``ShardedTable.sample``: a report of each shard's mass, the split,
  each remote shard's part drawn and packed on its node and sent as one
  array, the head's part gathered from shared memory);
* ``one``: the learner draws the same batches from the head's shard alone
  through its local client (``Table.sample``): one unsharded table;
* ``ray``: the same bytes, the same way, with no table: per batch, an
  actor on each remote shard's node returns an array of that shard's
  share of the batch (the split of the batch's rows by the shards'
  masses), all in parallel, and the head's share is copied locally: Ray's
  own transfer of what a sharded batch moves, its ceiling here.

Rounds alternate which side goes first (this 2-vCPU box is noisy); it
prints the medians of batches/s and MB/s and of sharded/one and
sharded/ray per round.  Every node shares this box's two cores, so more
shards here cannot add CPU or bandwidth: the cells measure what a shard
costs, which docs/scaling.md turns into what N boxes would give.  Not a
test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import shmreplay
from harness import results
from harness.raycluster import LocalCluster, token_auth
from shmreplay.bench.workloads import WORKLOADS

token_auth()  # before anything imports ray: the cluster listens on every interface

BATCH = {"sac-mujoco": 256, "dqn-atari": 32}
LABELS = ("replay_node", "remote_node_1", "remote_node_2")


def timed(fn, batches: int) -> float:
    """Batches/s of ``fn()`` over ``batches`` calls, after one untimed."""
    fn()
    t0 = time.perf_counter()
    for _ in range(batches):
        fn()
    return batches / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--items", type=int, default=4096, help="items a shard holds")
    ap.add_argument("--workloads", nargs="+", default=["sac-mujoco", "dqn-atari"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import ray
    import shmreplay.ray as sray

    @ray.remote(num_cpus=0)
    def fill(writer, rows, priorities):
        writer.insert_batch(rows, priorities)
        writer.flush()
        return writer.shard

    @ray.remote(num_cpus=0)
    class Source:
        """Ray's own transfer: an array of ``nbytes`` made once, sent per call."""

        def __init__(self):
            self.arrays = {}

        def give(self, nbytes: int):
            if nbytes not in self.arrays:
                self.arrays[nbytes] = np.ones(nbytes, np.uint8)
            return self.arrays[nbytes]

    cluster = LocalCluster(remote_cpus=1, object_store_bytes=300_000_000, remote_nodes=2)
    report = {"cells": []}
    try:
        cluster.start()
        cluster.connect(runtime_env={"env_vars": {
            "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(shmreplay.__file__)))}})
        nodes = cluster.node_ids()
        shards = sray.start_shards(nodes)
        sources = [Source.options(resources={label: 0.001}).remote() for label in LABELS]
        try:
            for wl in a.workloads:
                w = WORKLOADS[wl]
                b = BATCH[wl]
                rng = np.random.default_rng(0)
                name = wl.replace("-", "_")
                whole = sray.ShardedTable.create(shards, name, capacity=3 * a.items, fields=w.fields, seed=1)
                ray.get([fill.options(resources={label: 0.001}).remote(whole.writer(), w.rows(a.items),
                                                                      rng.uniform(0.5, 2.0, a.items))
                         for label in LABELS])
                local = shmreplay.connect(shards[0].socket)
                one = local.table(name)
                for n in a.shards:
                    t = sray.ShardedTable(shards[:n], name, seed=2)
                    masses = np.array([r["mass"] for _, r in sorted(t.book.reports().items())])
                    share = np.round(b * masses / masses.sum()).astype(int)
                    parts = [int(k) * w.item_bytes for k in share]

                    def ray_side():
                        refs = [sources[s].give.remote(parts[s]) for s in range(1, n)]
                        np.copyto(np.empty(parts[0], np.uint8), np.ones(parts[0], np.uint8))
                        ray.get(refs)

                    sides = {"sharded": lambda: t.sample(b), "one": lambda: one.sample(b), "ray": ray_side}
                    cell = {"workload": wl, "shards": n, "batch": b, **{k: [] for k in sides}}
                    for r in range(a.rounds):
                        order = list(sides) if r % 2 == 0 else list(reversed(list(sides)))
                        for side in order:
                            cell[side].append(timed(sides[side], a.batches))
                    t.close()
                    mb = b * w.item_bytes / 1e6
                    med = {k: statistics.median(cell[k]) for k in sides}
                    cell["vs_one"] = statistics.median(s / o for s, o in zip(cell["sharded"], cell["one"]))
                    cell["vs_ray"] = statistics.median(s / o for s, o in zip(cell["sharded"], cell["ray"]))
                    report["cells"].append(cell)
                    print(f"{wl:10s} {n} shard(s), batch {b}: sharded {med['sharded']:7.1f} batches/s "
                          f"({med['sharded'] * mb:7.1f} MB/s), one table {med['one']:7.1f} "
                          f"({med['one'] * mb:7.1f} MB/s), Ray's transfer {med['ray']:7.1f} "
                          f"({med['ray'] * mb:7.1f} MB/s); sharded/one {cell['vs_one']:.2f}, "
                          f"sharded/ray {cell['vs_ray']:.2f}", flush=True)
                local.close()
                whole.drop()
        finally:
            for s in sources:
                ray.kill(s)
            sray.stop_shards(shards)
    finally:
        cluster.stop()
    print("wrote", results.write(report, "shards", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
