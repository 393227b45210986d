#!/usr/bin/env python3
"""A torch learner's input pipeline into device tensors (issue 23, item 4).

    python3 benchmarks/gpu_learner.py [--device cuda] [--actors 0 4 8] [--seconds 5]

Batches of 256 dqn-atari rows (28 KB each, ../shared/WORKLOADS.md) from a
prioritized table of 20,000 items in a private daemon (``shmreplay.Server``),
into tensors on ``--device``, alone and with N actor processes inserting
the same rows as fast as they can.  Cells, batches/s (and GB/s of rows):

* ``ceiling``: the pinned host-to-device copy of the same bytes, nothing
  else (one pinned buffer, ``non_blocking`` copy, synchronize): no input
  pipeline can beat it.
* ``shmreplay.torch``: ``srt.iterate(table, 256, pin_memory=True)``: rows
  gathered from shared memory straight into pinned tensors (one host
  copy), then ``b.to(device)`` (asynchronous; the iterator waits for it
  before refilling the buffer), then a synchronize per batch, as a
  training step that uses the batch would.
* ``numpy+pin``: the path without ``shmreplay.torch``: ``t.iterate`` into
  numpy arrays, ``torch.from_numpy(...).pin_memory()`` (a second host
  copy), then the device copy.

On a machine without CUDA, ``--device cpu`` runs the same cells without
the device copy and without pinning (the ceiling is then a plain copy of
the batch's bytes).  Prints a table and one JSON line.  Not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import numpy as np

import shmreplay
from shmreplay.bench.workloads import WORKLOADS

W = WORKLOADS["dqn-atari"]
CAPACITY = 20_000


def actor(client, stop, seed) -> None:
    t = client.table("dqn")
    rows = W.rows(64, seed)
    while not stop.is_set():
        t.insert_batch(rows)
    client.close()


def timed(seconds: float, step) -> float:
    step()  # warm: first-touch, allocator, CUDA context
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return n / (time.perf_counter() - t0)


def cells(table, device, seconds: float) -> dict:
    import torch
    import shmreplay.torch as srt
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch_bytes = W.batch * W.item_bytes
    out = {}

    host = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(batch_bytes, dtype=torch.uint8, device=device)

    def ceiling():
        dev.copy_(host, non_blocking=True)
        sync()
    out["ceiling"] = timed(seconds, ceiling)

    with srt.iterate(table, W.batch, pin_memory=cuda) as it:
        def ours():
            b = next(it)
            d = b.to(device) if cuda else b
            sync()
            return d
        out["shmreplay.torch"] = timed(seconds, ours)

    with table.iterate(W.batch) as it:
        def plain():
            b = next(it)
            ts = {k: torch.from_numpy(a) for k, a in b.data.items()}
            if cuda:
                ts = {k: v.pin_memory().to(device, non_blocking=True) for k, v in ts.items()}
            else:
                ts = {k: v.clone() for k, v in ts.items()}  # the second host copy
            sync()
            return ts
        out["numpy+pin"] = timed(seconds, plain)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="default: cuda if there is one, else cpu")
    ap.add_argument("--actors", type=int, nargs="+", default=[0, 4, 8])
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args(argv)
    import torch
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    table = dict(name="dqn", capacity=CAPACITY, fields=W.fields, sampler="prioritized", alpha=0.6)
    ctx = mp.get_context("spawn")
    results = {}
    with shmreplay.Server(tables=[table]) as server:
        client = server.connect()
        t = client.table("dqn")
        rows = W.rows(1000)
        for _ in range(CAPACITY // 1000):
            t.insert_batch(rows)
        t.flush()
        for n in a.actors:
            stop = ctx.Event()
            procs = [ctx.Process(target=actor, args=(client, stop, i)) for i in range(n)]
            for p in procs:
                p.start()
            ins0, t0 = t.inserts, time.monotonic()
            results[n] = cells(t, device, a.seconds)
            results[n]["inserts/s"] = (t.inserts - ins0) / (time.monotonic() - t0)
            stop.set()
            for p in procs:
                p.join(60)
        client.close()
    gb = W.batch * W.item_bytes / 1e9
    print(f"device {device}; batches/s of {W.batch} dqn-atari rows ({W.item_bytes:,} B each)")
    print(f"{'actors':>6} | {'ceiling':>16} | {'shmreplay.torch':>16} | {'numpy+pin':>16} | inserts/s")
    for n, r in results.items():
        cell = [f"{r[k]:7.0f} ({r[k] * gb:4.1f} GB/s)" for k in ("ceiling", "shmreplay.torch", "numpy+pin")]
        print(f"{n:>6} | " + " | ".join(cell) + f" | {r['inserts/s']:9.0f}")
    print(json.dumps({"device": str(device), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
