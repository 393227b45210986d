#!/usr/bin/env python3
"""Does a flood of connections to the metrics port slow the data path?
(issue 34, item 3)

    python3 benchmarks/metrics_flood.py [--connections 10000] [--quiet-s 5]

One private daemon with ``metrics_port``, one client that alternates an
insert (64 sac-mujoco rows, then ``flush``: the round trip to the commit)
and a sample (a batch of 256), timing each call.  Three phases in one
run: quiet; while a second process opens ``--connections`` connections to
the metrics port that never send a byte, holds every one open, then drops
them all at once; quiet again.  Prints p50/p99 of both calls per phase,
the flood's over the quiet phases' as ratios, the first scrapes' latency
right after the flood dropped, and the daemon's threads and memory
before and after.  Not a test: one run's figures, on whatever box runs it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
import urllib.request

import numpy as np

import shmreplay
from shmreplay.bench.workloads import WORKLOADS

W = WORKLOADS["sac-mujoco"]


def flood(host: str, port: int, n: int, opened, drop) -> None:
    """Open ``n`` connections that never send, hold them until ``drop``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard != resource.RLIM_INFINITY
                                                    else want, hard))
    socks, failed = [], 0
    for _ in range(n):
        try:
            socks.append(socket.create_connection((host, port), timeout=30))
        except OSError:
            failed += 1
    opened.put((len(socks), failed))
    drop.wait(600)
    for s in socks:
        s.close()


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e3  # ms


def data_path(c, t, rows, until) -> dict:
    """Insert and sample in turn until ``until()``; each call's seconds."""
    lat = {"insert": [], "sample": []}
    while not until():
        t0 = time.perf_counter()
        t.insert_batch(rows)
        c.flush()
        t1 = time.perf_counter()
        t.sample(256)
        t2 = time.perf_counter()
        lat["insert"].append(t1 - t0)
        lat["sample"].append(t2 - t1)
    return lat


def timed_scrape(url: str) -> float:
    t0 = time.perf_counter()
    urllib.request.urlopen(url, timeout=30).read()
    return time.perf_counter() - t0


def daemon_numbers(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return f"{len(os.listdir(f'/proc/{pid}/task'))} threads, {rss / 1024:.0f} MiB resident"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--quiet-s", type=float, default=5.0)
    a = ap.parse_args(argv)
    table = dict(name="sac", capacity=100_000, fields=W.fields)
    ctx = mp.get_context("spawn")
    with shmreplay.Server(tables=[table], metrics_port=0) as server:
        c = server.connect()
        t = c.table("sac")
        rows = W.rows(64)
        t.insert_batch(W.rows(10_000))
        c.flush()
        st = c.stats()
        pid, url = st["daemon_pid"], st["metrics"]
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        timed_scrape(url)
        print(f"daemon before: {daemon_numbers(pid)}")
        phases = {}
        end = time.perf_counter() + a.quiet_s
        phases["quiet before"] = data_path(c, t, rows, lambda: time.perf_counter() > end)
        opened, drop = ctx.Queue(), ctx.Event()
        flooder = ctx.Process(target=flood, args=(host, int(port), a.connections, opened, drop))
        t0 = time.perf_counter()
        flooder.start()
        result = []

        def flood_done():
            if not result and not opened.empty():
                result.append(opened.get())
            return bool(result)
        phases["flood"] = data_path(c, t, rows, flood_done)
        made, failed = result[0]
        print(f"flood: {made} connections open ({failed} failed) after {time.perf_counter() - t0:.1f} s; "
              f"daemon now: {daemon_numbers(pid)}")
        drop.set()
        flooder.join(120)
        scrapes = [timed_scrape(url) for _ in range(10)]
        print(f"scrapes right after the flood dropped: first {scrapes[0] * 1e3:.1f} ms, "
              f"slowest of 10 {max(scrapes) * 1e3:.1f} ms")
        end = time.perf_counter() + a.quiet_s
        phases["after the flood"] = data_path(c, t, rows, lambda: time.perf_counter() > end)
        end = time.perf_counter() + a.quiet_s
        phases["quiet after"] = data_path(c, t, rows, lambda: time.perf_counter() > end)
        print(f"daemon after: {daemon_numbers(pid)}")
        c.close()
    print(f"{'phase':>16} {'calls':>6} {'insert p50':>11} {'p99':>8} {'sample p50':>11} {'p99':>8}  (ms)")
    for name, lat in phases.items():
        print(f"{name:>16} {len(lat['insert']):6d} {pct(lat['insert'], 50):11.3f} {pct(lat['insert'], 99):8.3f} "
              f"{pct(lat['sample'], 50):11.3f} {pct(lat['sample'], 99):8.3f}")
    quiet = {k: phases["quiet before"][k] + phases["quiet after"][k] for k in ("insert", "sample")}
    for k in ("insert", "sample"):
        print(f"{k}: flood / quiet p50 {pct(phases['flood'][k], 50) / pct(quiet[k], 50):.2f}x, "
              f"p99 {pct(phases['flood'][k], 99) / pct(quiet[k], 99):.2f}x; "
              f"after the flood / quiet p99 {pct(phases['after the flood'][k], 99) / pct(quiet[k], 99):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
