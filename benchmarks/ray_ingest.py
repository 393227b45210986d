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

Prints items/s and MB/s per cell and remote/ray (target >= 0.8).  Not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shmreplay  # noqa: E402
from shmreplay.bench.workloads import WORKLOADS  # noqa: E402

CHUNK, IN_FLIGHT = 64, 2
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def start_cluster(temp: str) -> tuple[list, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, **ENV)
    common = ["--block", "--node-ip-address=127.0.0.1", "--object-store-memory=500000000",
              "--disable-usage-stats", f"--temp-dir={temp}"]
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start"]
    head = subprocess.Popen(cmd + common + ["--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                                            "--resources=" + json.dumps({"replay_node": 1})],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(6)
    worker = subprocess.Popen(cmd + common + [f"--address=127.0.0.1:{port}", "--num-cpus=8",
                                              "--resources=" + json.dumps({"remote_node": 8})],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return [head, worker], f"127.0.0.1:{port}"


def stop_cluster(nodes: list) -> None:
    for p in reversed(nodes):
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(2)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


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
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--workloads", nargs="+", default=["sac-mujoco", "dqn-atari"])
    a = ap.parse_args(argv)
    os.environ.update(ENV)
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
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                w.insert_batch(rows)
                n += CHUNK
            w.flush()
            return n, time.perf_counter() - t0
        pending, n, t0 = [], 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:  # the same pattern, no table behind it
            if len(pending) >= IN_FLIGHT:
                ray.get(pending.pop(0))
            pending.append(target.take.remote(rows, None))
            n += CHUNK
        ray.get(pending)
        return n, time.perf_counter() - t0

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    nodes, address = start_cluster(temp)
    results = []
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}})
        head = next(nd["NodeID"] for nd in ray.nodes() if nd["Alive"] and "replay_node" in nd["Resources"])
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        sink = Sink.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
        for wl in a.workloads:
            w = WORKLOADS[wl]
            rows = w.rows(CHUNK)
            cap = 200_000 if w.item_bytes < 10_000 else 20_000
            with shmreplay.Server(tables=[dict(name="t", capacity=cap, fields=w.fields, sampler="uniform")]) as srv:
                ingest = sray.start_ingest(srv.socket, "t", node_id=head)
                rows_ref = ray.put(rows)
                for n in a.producers:
                    cell = {"workload": wl, "producers": n}
                    for side, target in (("remote", ingest), ("ray", sink)):
                        got = ray.get([produce.remote(target, rows_ref, a.seconds, side == "remote")
                                       for _ in range(n)])
                        cell[side] = sum(k for k, _ in got) / max(s for _, s in got)
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
                    print(f"{wl:>10} x{n}: remote {cell['remote']:9,.0f} items/s "
                          f"({cell['remote'] * cell['mb']:7.1f} MB/s)  ray {cell['ray']:9,.0f} "
                          f"({cell['ray'] * cell['mb']:7.1f} MB/s)  local {cell['local']:10,.0f}  "
                          f"remote/ray {cell['remote'] / cell['ray']:.2f}", flush=True)
                ray.kill(ingest)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_cluster(nodes)
        shutil.rmtree(temp, ignore_errors=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
