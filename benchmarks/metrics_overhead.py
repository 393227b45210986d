#!/usr/bin/env python3
"""Does serving Prometheus metrics slow the data path? (issue 24, item 4)

    python3 benchmarks/metrics_overhead.py [--rounds 4] [--seconds 5]

The sample cell of sac-mujoco (batches of 256 from a 1,000,000-item
prioritized table, one learner, sample + update_priorities) against two
private daemons in the same run, rounds alternating: one without metrics,
one with ``metrics_port`` and a scraper process fetching /metrics every
second.  Prints batches/s per round and the ratio of medians.  Not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import urllib.request

import numpy as np

import shmreplay
from shmreplay.bench.workloads import WORKLOADS

W = WORKLOADS["sac-mujoco"]


def scraper(url: str, stop) -> None:
    while not stop.wait(1.0):
        urllib.request.urlopen(url, timeout=10).read()


def cell(t, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = t.sample(W.batch)
        t.update_priorities(b.keys, np.abs(b.data["reward"]) + 0.1)
        n += 1
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args(argv)
    table = dict(name="sac", capacity=W.capacity, fields=W.fields, sampler="prioritized", alpha=0.6)
    ctx = mp.get_context("spawn")
    results = {"off": [], "on+scraper": []}
    with shmreplay.Server(tables=[table]) as off, shmreplay.Server(tables=[table], metrics_port=0) as on:
        sides = {}
        for name, server in (("off", off), ("on+scraper", on)):
            c = server.connect()
            t = c.table("sac")
            rows = W.rows(10_000)
            for _ in range(W.capacity // 10_000):
                t.insert_batch(rows)
            t.flush()
            sides[name] = (c, t)
        url = sides["on+scraper"][0].stats()["metrics"]
        stop = ctx.Event()
        scrape = ctx.Process(target=scraper, args=(url, stop))
        scrape.start()
        try:
            for r in range(a.rounds):
                for name in (("off", "on+scraper") if r % 2 == 0 else ("on+scraper", "off")):
                    results[name].append(cell(sides[name][1], a.seconds))
        finally:
            stop.set()
            scrape.join(30)
    for name, xs in results.items():
        print(f"{name:>11}: " + "  ".join(f"{x:7.0f}" for x in xs) + f"   median {statistics.median(xs):7.0f} batches/s")
    ratio = statistics.median(results["on+scraper"]) / statistics.median(results["off"])
    print(f"with metrics served and scraped every second: {ratio:.3f}x the batches/s without")
    return 0


if __name__ == "__main__":
    sys.exit(main())
