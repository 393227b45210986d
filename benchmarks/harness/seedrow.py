"""The DQN Atari seed row of shared/WORKLOADS.md at its size, for
``benchmarks/capacity.py``: 400,000 items of ~110 KB (16 stacked 84x84
frames: obs and next_obs of 8 each, 112,905 bytes; 45 GB) in a file-backed
table, filled, then actors inserting at the seed's 400 items/s (5 % over)
while a prioritized learner samples (alpha 0.6, beta 0.4, a priority
update per batch) through ``iterate(prefetch=k)``: first at the seed's
1,650 items/s (is the seed served: both rates at once?), then as fast as
it goes (how much room is left; on 2 cores it takes CPU from the actors,
which run niced).  The table is dropped (its file removed) at the end, whatever
happened.

Runs in the benchmark's process (the learner) with actor processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

from shmreplay.bench.peers import ACTOR_NICE, nice
from .disk import BenchDaemon, learner, prefetch_stats

FIELDS = {"obs": ("uint8", (8, 84, 84)), "next_obs": ("uint8", (8, 84, 84)), "action": ("int32", ()),
          "reward": ("float32", ()), "done": ("bool", ())}
SEED_INSERTS, SEED_SAMPLES = 400, 1650
OFFERED = 420  # items/s the actors aim at: 5% over the seed's, so a sustained rate reads >= 400
PACED = 1733   # items/s the paced learner aims at: 5% over the seed's 1,650, for the same reason
BATCH = 256


def _rows(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.integers(0, 256, (n, 8, 84, 84), dtype=np.uint8),
            "next_obs": rng.integers(0, 256, (n, 8, 84, 84), dtype=np.uint8),
            "action": rng.integers(0, 18, n, dtype=np.int32), "reward": rng.standard_normal(n).astype(np.float32),
            "done": rng.random(n) < 0.01}


def _reporting(fn):
    """A worker that always reports: its result, or its error (so the
    benchmark never waits for a worker that died)."""
    def run(*args):
        out = args[-1]
        try:
            out.put(fn(*args[:-1]))
        except BaseException as exc:
            out.put(RuntimeError(f"{fn.__name__}: {exc!r}"))
    return run


def _get(out) -> float:
    got = out.get(timeout=24 * 3600)
    if isinstance(got, BaseException):
        raise got
    return got


def _filler(sock: str, items: int, seed: int) -> int:
    import shmreplay
    nice(ACTOR_NICE)
    with shmreplay.connect(sock, timeout=120) as c:
        t = c.table("seed")
        rows = _rows(32, seed)
        for lo in range(0, items, 32):
            k = min(32, items - lo)
            t.insert_batch({f: v[:k] for f, v in rows.items()})
        c.flush()
    return items


def _actor(sock: str, rate: float, seconds: float, seed: int, start) -> float:
    """One item at a time at ``rate`` items/s (an environment's pace)."""
    import shmreplay
    nice(ACTOR_NICE)
    with shmreplay.connect(sock, timeout=120) as c:
        t = c.table("seed")
        rows = _rows(8, seed)
        start.wait()
        n, t0 = 0, time.monotonic()
        while (now := time.monotonic()) - t0 < seconds:
            ahead = n / rate - (now - t0)
            if ahead > 0:
                time.sleep(min(ahead, 0.05))
                continue
            t.insert(**{f: v[n % 8] for f, v in rows.items()})
            n += 1
        c.flush()
        return n / (time.monotonic() - t0)


def _phase(daemon, ctx, table, seconds: float, prefetch: int, actors: int, rate) -> tuple[float, dict]:
    """Actors at ``OFFERED`` items/s and the learner (at ``rate``, None:
    flat out) for ``seconds``: (inserts/s, the learner's rates)."""
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_reporting(_actor), args=(daemon.socket, OFFERED / actors, seconds, 10 + i,
                                                          start, out)) for i in range(actors)]
    for p in procs:
        p.start()
    start.set()
    got = learner(table, BATCH, 10**9, seconds, prefetch, rate)
    inserts = sum(_get(out) for _ in procs)
    for p in procs:
        p.join(60)
    return inserts, got


def run(daemon: BenchDaemon, capacity: int, seconds: float, prefetch: int = 2, actors: int = 2,
        log=print) -> dict:
    """Fill a seed table of ``capacity`` items, then run actors and the
    learner for ``seconds``; drop the table at the end."""
    ctx = mp.get_context("fork")
    item = sum(np.dtype(d).itemsize * int(np.prod(s)) for d, s in FIELDS.values())
    c = daemon.connect()
    res: dict = {"capacity": capacity, "item_bytes": item, "GB": capacity * item / 1e9}
    c.create_table("seed", capacity=capacity, fields=FIELDS, sampler="prioritized", alpha=0.6,
                   storage_dir=daemon.store)  # DiskFull when the disk cannot hold it: nothing made
    try:
        log(f"  seed row: filling {capacity:,} x {item:,} bytes ({res['GB']:.1f} GB)")
        out = ctx.Queue()
        t0 = time.monotonic()
        procs = [ctx.Process(target=_reporting(_filler),
                             args=(daemon.socket, capacity // actors + (i < capacity % actors), i, out))
                 for i in range(actors)]
        for p in procs:
            p.start()
        for p in procs:
            _get(out)
            p.join()
        res["fill_s"] = round(time.monotonic() - t0, 1)
        res["fill_items_per_s"] = capacity / res["fill_s"]
        log(f"  seed row: filled in {res['fill_s']:.0f} s ({res['fill_items_per_s']:,.0f} items/s); "
            f"{seconds:.0f} s with actors at {OFFERED} items/s and the learner at the seed's "
            f"{SEED_SAMPLES:,} items/s (aiming 5% over), then {seconds:.0f} s with it as fast as it goes")
        before = prefetch_stats(c, "seed")
        for phase, rate in (("", PACED), ("max_", None)):
            ins, got = _phase(daemon, ctx, c.table("seed"), seconds, prefetch, actors, rate)
            res[phase + "inserts_per_s"], res[phase + "samples_per_s"] = ins, got["rows_per_s"]
            res[phase + "sample_GB_per_s"] = got["GB_per_s"]
        after = prefetch_stats(c, "seed")
        res["prefetch"] = prefetch
        res.update({k: after[k] - before.get(k, 0) for k in after})
        res["vs_seed_inserts"] = res["inserts_per_s"] / SEED_INSERTS
        res["vs_seed_samples"] = res["samples_per_s"] / SEED_SAMPLES
    finally:
        try:
            c.drop_table("seed")  # removes the rows file
        finally:
            c.close()
    res["file_removed"] = not any(n.endswith(".r.seed") for n in os.listdir(daemon.store))
    return res
