#!/usr/bin/env python3
"""Remote ingest through Ray against local writers and Ray's own transfer (issue 25, item 4).

    python3 benchmarks/ray_ingest.py [--producers 1 2 4] [--seconds 5] [--workloads sac-mujoco dqn-atari]

Starts a two-node Ray cluster on 127.0.0.1 (``ray start --block``: a head
labelled ``replay_node``, a second node labelled ``remote_node``) and a
private shmreplayd, then, per workload and producer count N, in one run:

* ``remote``: N Ray actors on the second node send chunks of 64 rows
  through ``shmreplay.ray.RemoteWriter`` (2 chunks in flight each) to the
  ingest on the head node, which inserts them into the table;
* ``ray``: the same actors send the same chunks, the same way (2 in
  flight), to a sink actor on the head node that only touches them: Ray's
  own object-store transfer of those bytes, the ceiling of the path;
* ``local``: N local processes insert the same chunks with
  ``insert_batch`` through shared memory.

Each cell runs ``remote`` and ``ray`` ``--rounds`` times, alternating which
goes first (this 2-vCPU box is noisy), and prints the medians of items/s
and MB/s and of the per-round remote/ray (target >= 0.8), with what a
chunk costs the ingest (inserting, flushing) and the daemon (its CPU).
Not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shmreplay  # noqa: E402
from shmreplay.bench.raycluster import LocalCluster  # noqa: E402
from shmreplay.bench.workloads import WORKLOADS  # noqa: E402

CHUNK, IN_FLIGHT = 64, 2


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used (/proc/PID/stat)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def local_writer(socket_path, name, rows, seconds, out) -> None:
    c = shmreplay.connect(socket_path)
    t = c.table(name)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t.insert_batch(rows)
        n += CHUNK
    c.flush()
    out.put((n, time.perf_counter() - t0))
    c.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3, help="remote/ray alternations per cell (median reported)")
    ap.add_argument("--workloads", nargs="+", default=["sac-mujoco", "dqn-atari"])
    a = ap.parse_args(argv)
    import ray
    import shmreplay.ray as sray

    @ray.remote(num_cpus=0)
    class Sink:
        def take(self, chunk, prios):
            return sum(v.shape[0] for v in chunk.values()) // len(chunk)

    @ray.remote(num_cpus=0, resources={"remote_node": 1})
    def produce(target, rows, seconds, via_writer: bool):
        if via_writer:
            w = sray.RemoteWriter(target, chunk=CHUNK, in_flight=IN_FLIGHT)
            w.insert_batch(rows)  # warm-up, untimed: this worker's first call and object transfer
            w.flush()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                w.insert_batch(rows)
                n += CHUNK
            w.flush()
            return n, time.perf_counter() - t0
        ray.get(target.take.remote(rows, None))  # warm-up, untimed
        pending, n, t0 = [], 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:  # the same pattern, no table behind it
            if len(pending) >= IN_FLIGHT:
                ray.get(pending.pop(0))
            pending.append(target.take.remote(rows, None))
            n += CHUNK
        ray.get(pending)
        return n, time.perf_counter() - t0

    cluster = LocalCluster(remote_cpus=8, object_store_bytes=500_000_000)
    results = []
    try:
        cluster.start()
        head = cluster.connect(runtime_env={"env_vars": {
            "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}})
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        sink = Sink.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
        for wl in a.workloads:
            w = WORKLOADS[wl]
            rows = w.rows(CHUNK)
            cap = 200_000 if w.item_bytes < 10_000 else 20_000
            with shmreplay.Server(tables=[dict(name="t", capacity=cap, fields=w.fields, sampler="uniform")]) as srv:
                ingest = sray.start_ingest(srv.socket, "t", node_id=head)
                ray.get(ingest.stats.remote())  # started and connected (its numba import), untimed
                rows_ref = ray.put(rows)
                for n in a.producers:
                    cell = {"workload": wl, "producers": n, "remote": [], "ray": [], "ratio": []}
                    cost = {"insert_us": 0.0, "flush_us": 0.0, "daemon_cpu_us": 0.0, "chunks": 0}
                    for r in range(a.rounds):  # alternating which side goes first
                        sides = (("remote", ingest), ("ray", sink))
                        for side, target in (sides if r % 2 == 0 else sides[::-1]):
                            before, cpu0 = ray.get(ingest.stats.remote()), cpu_seconds(srv.pid)
                            got = ray.get([produce.remote(target, rows_ref, a.seconds, side == "remote")
                                           for _ in range(n)])
                            cell[side].append(sum(k for k, _ in got) / max(s for _, s in got))
                            if side == "remote":  # what a chunk costs the ingest and the daemon
                                after = ray.get(ingest.stats.remote())
                                cost["chunks"] += after["chunks"] - before["chunks"]
                                cost["insert_us"] += (after["insert_s"] - before["insert_s"]) * 1e6
                                cost["flush_us"] += (after["flush_s"] - before["flush_s"]) * 1e6
                                cost["daemon_cpu_us"] += (cpu_seconds(srv.pid) - cpu0) * 1e6
                        cell["ratio"].append(cell["remote"][-1] / cell["ray"][-1])
                    chunks = max(1, cost.pop("chunks"))
                    cell.update({k: v / chunks for k, v in cost.items()})
                    ctx = mp.get_context("spawn")
                    q = ctx.Queue()
                    procs = [ctx.Process(target=local_writer, args=(srv.socket, "t", rows, a.seconds, q))
                             for _ in range(n)]
                    for p in procs:
                        p.start()
                    got = [q.get(timeout=600) for _ in procs]
                    for p in procs:
                        p.join(60)
                    cell["local"] = sum(k for k, _ in got) / max(s for _, s in got)
                    cell["mb"] = w.item_bytes / 1e6
                    results.append(cell)
                    med = {k: statistics.median(cell[k]) for k in ("remote", "ray", "ratio")}
                    print(f"{wl:>10} x{n}: remote {med['remote']:9,.0f} items/s "
                          f"({med['remote'] * cell['mb']:7.1f} MB/s)  ray {med['ray']:9,.0f} "
                          f"({med['ray'] * cell['mb']:7.1f} MB/s)  local {cell['local']:10,.0f}  "
                          f"remote/ray {med['ratio']:.2f} (rounds {' '.join(f'{x:.2f}' for x in cell['ratio'])})"
                          f"  per chunk: ingest insert {cell['insert_us']:.0f} us, flush {cell['flush_us']:.0f} us,"
                          f" daemon cpu {cell['daemon_cpu_us']:.0f} us", flush=True)
                ray.kill(ingest)
    finally:
        cluster.stop()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
