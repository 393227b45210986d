#!/usr/bin/env python3
"""How long a checkpoint stops inserts and samples, and how fast it writes.

    python benchmarks/checkpoint.py [--capacity 1000000] [--row-bytes 165] [--insert-rate 2000]

Starts a daemon with one full table, then takes a checkpoint while one
process inserts and another samples.  Reports the engine pause (the only
time inserts and samples wait: a copy of the committed items' metadata),
the write time and rate, the longest gap between the workers' calls during
the checkpoint next to their median gap before it, and, as the baseline of
the same run, how fast numpy copies the same bytes in memory.  Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import shmreplay


def worker(sock, kind, stop, out, rate):
    c = shmreplay.connect(sock, timeout=60)
    t = c.table("ck")
    row = np.zeros(t.spec.fields[0].shape, np.uint8)
    stamps = []
    t0 = time.monotonic()
    while not stop.is_set():
        if kind == "insert":
            if rate and len(stamps) > (time.monotonic() - t0) * rate:
                time.sleep(1e-4)
                continue
            t.insert(x=row)
        else:
            t.sample(256)
        stamps.append(time.monotonic())
    out.put((kind, stamps))
    c.close()


def gaps(stamps, lo, hi):
    s = np.asarray(stamps)
    d = np.diff(s)
    inside = d[(s[1:] > lo) & (s[:-1] < hi)]
    before = d[s[1:] < lo]
    return (float(inside.max()) if inside.size else float("nan"),
            float(np.median(before)) if before.size else float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--row-bytes", type=int, default=165)
    ap.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--insert-rate", type=float, default=2000.0,
                    help="items/s the inserting process aims at (0: as fast as it can)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="shmr-ckbench")
    ckdir = a.dir or os.path.join(work, "ck")
    server = shmreplay.Server(instance=f"ckbench{os.getpid()}", tables=[dict(
        name="ck", capacity=a.capacity, sampler="prioritized", fields={"x": ("uint8", (a.row_bytes,))})])
    sock = server.socket
    try:
        c = server.connect(timeout=60)
        t = c.table("ck")
        chunk = np.zeros((65536, a.row_bytes), np.uint8)
        for lo in range(0, a.capacity, 65536):
            n = min(65536, a.capacity - lo)
            t.insert_batch({"x": chunk[:n]}, priorities=np.random.uniform(0.1, 2.0, n))
        c.flush()
        ctx = mp.get_context("fork")
        stop, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(sock, k, stop, out, a.insert_rate))
                 for k in ("insert", "sample")]
        for p in procs:
            p.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        (rep,) = c.checkpoint(ckdir, "ck")
        t1 = time.monotonic()
        time.sleep(0.5)
        stop.set()
        stamps = dict(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
        total = a.capacity * a.row_bytes
        src = np.zeros(total, np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # first touch: page faults, not copying
        m0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy_GBps = total / (time.perf_counter() - m0) / 1e9
        result = {
            "capacity": a.capacity, "row_bytes": a.row_bytes, "insert_rate": a.insert_rate,
            "items": rep["items"],
            "dropped": rep["dropped"], "MiB": rep["bytes"] / 2**20,
            "engine_pause_ms": 1e3 * rep["pause_s"], "write_s": rep["write_s"],
            "write_GBps": rep["bytes"] / rep["write_s"] / 1e9, "numpy_copy_GBps": memcpy_GBps,
        }
        for k, s in stamps.items():
            worst, usual = gaps(s, t0, t1)
            result[f"{k}_max_gap_ms_during"] = 1e3 * worst
            result[f"{k}_median_gap_ms_before"] = 1e3 * usual
        print(json.dumps(result, indent=1))
        c.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
