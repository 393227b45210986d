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
and MB/s and of the per-round remote/ray (target >= 0.8), and where each
side's CPU went per chunk (from /proc): the producers' processes, the
receiving actor's (ingest or sink), the daemon's, the whole box's, and
the box's idle share; with the ingest's insert and flush wall time.  The
producer workers are started before any timed round.  Not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import shmreplay
from shmreplay.bench.peers import process_cpu_seconds as cpu_seconds
from harness.raycluster import LocalCluster, token_auth
from shmreplay.bench.workloads import WORKLOADS

token_auth()  # before anything imports ray: the cluster listens on every interface

CHUNK, IN_FLIGHT = 64, 2


def box_cpu() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole box so far (/proc/stat)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = f[3] + f[4]  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK"), idle / os.sysconf("SC_CLK_TCK")


def run_side(produce, receiver, daemon_pid, rows_ref, n, seconds, ingest) -> dict:
    """One side's round: n producers for ``seconds``; items/s, and per
    chunk: the CPU of the producers (their processes), of the receiving
    actor (ingest or sink), of the daemon and of the whole box, the box's
    idle share, and (remote) the ingest's insert and flush wall time."""
    import ray
    target, rpid = receiver
    st0 = ray.get(ingest.stats.remote()) if ingest is not None else None
    (busy0, idle0), rc0, dc0, t0 = box_cpu(), cpu_seconds(rpid), cpu_seconds(daemon_pid), time.perf_counter()
    got = ray.get([produce.remote(target, rows_ref, seconds, ingest is not None) for _ in range(n)])
    (busy1, idle1), wall = box_cpu(), time.perf_counter() - t0
    rc1, dc1 = cpu_seconds(rpid), cpu_seconds(daemon_pid)
    items = sum(g[0] for g in got)
    chunks = max(1, items / CHUNK)
    out = {"items_s": items / max(g[1] for g in got),
           "producer_us": sum(g[2] for g in got) / chunks * 1e6,
           "receiver_us": (rc1 - rc0) / chunks * 1e6, "daemon_us": (dc1 - dc0) / chunks * 1e6,
           "box_us": (busy1 - busy0) / chunks * 1e6, "idle": (idle1 - idle0) / (wall * os.cpu_count())}
    if ingest is not None:
        st1 = ray.get(ingest.stats.remote())
        k = max(1, st1["chunks"] - st0["chunks"])
        out["insert_us"] = (st1["insert_s"] - st0["insert_s"]) / k * 1e6
        out["flush_us"] = (st1["flush_s"] - st0["flush_s"]) / k * 1e6
    return out


def report(wl: str, n: int, cell: dict, mb: float) -> str:
    """One cell's medians: rates, ratio, and where each side's CPU went."""
    def med(side, key):
        return statistics.median(r[key] for r in cell[side])
    rem, ray_ = med("remote", "items_s"), med("ray", "items_s")
    cpu = "  ".join(f"{k[:-3]} {med('remote', k):5.0f}/{med('ray', k):<5.0f}"
                    for k in ("producer_us", "receiver_us", "daemon_us", "box_us"))
    return (f"{wl:>10} x{n}: remote {rem:9,.0f} items/s ({rem * mb:6.1f} MB/s)  ray {ray_:9,.0f} "
            f"({ray_ * mb:6.1f} MB/s)  local {cell['local']:10,.0f}  remote/ray "
            f"{statistics.median(cell['ratio']):.2f} (rounds {' '.join(f'{x:.2f}' for x in cell['ratio'])})\n"
            f"{'':>14}CPU us per chunk, remote/ray: {cpu}  idle {med('remote', 'idle'):.0%}/{med('ray', 'idle'):.0%}"
            f"  ingest insert {med('remote', 'insert_us'):.0f} us + flush {med('remote', 'flush_us'):.0f} us (wall)")


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

        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0, resources={"remote_node": 1})
    def produce(target, rows, seconds, via_writer: bool):
        if via_writer:
            w = sray.RemoteWriter(target, chunk=CHUNK, in_flight=IN_FLIGHT)
            w.insert_batch(rows)  # warm-up, untimed: this worker's first call and object transfer
            w.flush()
            n, t0, c0 = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - t0 < seconds:
                w.insert_batch(rows)
                n += CHUNK
            w.flush()
            return n, time.perf_counter() - t0, time.process_time() - c0
        ray.get(target.take.remote(rows, None))  # warm-up, untimed
        pending, n, t0, c0 = [], 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:  # the same pattern, no table behind it
            if len(pending) >= IN_FLIGHT:
                ray.get(pending.pop(0))
            pending.append(target.take.remote(rows, None))
            n += CHUNK
        ray.get(pending)
        return n, time.perf_counter() - t0, time.process_time() - c0

    cluster = LocalCluster(remote_cpus=8, object_store_bytes=500_000_000)
    results = []
    try:
        cluster.start()
        # the workers import the shmreplay this driver measures (an editable checkout or an installed copy)
        head = cluster.connect(runtime_env={"env_vars": {
            "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(shmreplay.__file__)))}})
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
                # untimed: start as many producer workers as the largest cell
                # needs, both ways, so no timed round pays a worker's start
                ray.get([produce.remote(target, rows_ref, 0.3, target is ingest)
                         for target in (ingest, sink) for _ in range(max(a.producers))])
                receiver = {"remote": (ingest, ray.get(ingest.pid.remote())), "ray": (sink, ray.get(sink.pid.remote()))}
                for n in a.producers:
                    cell = {"workload": wl, "producers": n, "remote": [], "ray": [], "ratio": []}
                    for r in range(a.rounds):  # alternating which side goes first
                        for side in (("remote", "ray") if r % 2 == 0 else ("ray", "remote")):
                            cell[side].append(run_side(produce, receiver[side], srv.pid, rows_ref, n, a.seconds,
                                                       ingest if side == "remote" else None))
                        cell["ratio"].append(cell["remote"][-1]["items_s"] / cell["ray"][-1]["items_s"])
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
                    results.append(cell)
                    print(report(wl, n, cell, w.item_bytes / 1e6), flush=True)
                ray.kill(ingest)
    finally:
        cluster.stop()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
