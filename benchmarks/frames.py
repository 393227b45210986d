#!/usr/bin/env python3
"""Frame tables against rows and cpprb (issue 37, item 6): what a pixel
transition costs in memory, and how fast a learner samples its stacks.

    python3 benchmarks/frames.py [--items 1000000] [--rate-items 100000] [--seconds 4]
                                 [--rounds 3] [--r2d2 2000] [--out FILE]

One invocation, four parts, each in its own ``shmreplay.Server`` (or
process, for cpprb), one after another so their memory does not add up:

1. **memory at scale**: ``--items`` DQN Atari transitions (obs and
   next_obs ``uint8[4, 84, 84]``, action, reward, discount; n-step 3
   through ``NStepWriter``) into a frame table; its bytes a transition
   are the daemon's anonymous memory plus the table's pages in /dev/shm,
   over the items.  Target: 1,000,000 in <= 8 GB.
2. **sampling rates**: the same ``--rate-items`` stream in a frame table,
   a table of rows and cpprb's ``ReplayBuffer(stack_compress="obs",
   next_of="obs")`` (1-step: cpprb's compression does not take n-step)
   in one process; prioritized batches of 32 and 256 a second from each,
   in ``--rounds`` alternating rounds of ``--seconds``.  Target: frames
   >= 0.70 of rows, per batch size, medians.
3. **bytes a transition** of each of part 2's stores (cpprb: its process's
   memory growth over the items).
4. **R2D2 sequences**: ``--r2d2`` sequences of 80 steps of ``uint8[84,
   84]`` every 40 steps (``SequenceWriter``) as rows and as frames
   (``frames_per_item=40``): bytes a sequence, and sequences/s sampled in
   batches of 64.  Target: frames <= 0.55 of rows.

The stream: frames of random pixels (a pool, each made distinct by its
step number), episodes of 1,000 steps, stacks as gymnasium's
``FrameStackObservation`` makes them.  Prints a table; writes the JSON
(default ``benchmarks/results/frames-<time>.json``).  Speed is reported,
never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
from harness import results

import shmreplay


FRAME = (84, 84)
DEPTH, N_STEP, EPISODE = 4, 3, 1000
ATARI = {"obs": ("uint8", (DEPTH, *FRAME)), "next_obs": ("uint8", (DEPTH, *FRAME)),
         "action": ("int64", ()), "reward": ("float32", ()), "discount": ("float32", ())}
STACKS = {"obs": DEPTH, "next_obs": "obs"}
SEQ_LEN, SEQ_PERIOD = 80, 40
R2D2 = {"obs": ("uint8", (SEQ_LEN, *FRAME)), "length": ("int32", ())}


class Stream:
    """Distinct frames cheaply: a pool of random ones, step t's stamped with t."""

    def __init__(self, seed: int = 0, pool: int = 1024):
        self.pool = np.random.default_rng(seed).integers(0, 256, (pool, *FRAME), dtype=np.uint8)

    def frame(self, t: int) -> np.ndarray:
        f = self.pool[t % self.pool.shape[0]].copy()
        f.reshape(-1)[:8].view(np.uint64)[0] = t
        return f

    def steps(self, n: int):
        """(obs stack, next_obs stack, done) for n steps, episodes of EPISODE."""
        t = 0
        while t < n:
            first = t
            window = [self.frame(first)] * DEPTH  # padding "reset": the first frame repeated
            for k in range(min(EPISODE, n - t)):
                nxt = window[1:] + [self.frame(t + 1)]
                yield np.stack(window), np.stack(nxt), k == EPISODE - 1
                window = nxt
                t += 1


def shm_bytes(instance: str) -> int:
    """Pages the instance's segments hold in /dev/shm."""
    return sum(os.stat(f"/dev/shm/{n}").st_blocks * 512 for n in os.listdir("/dev/shm")
               if n.startswith(f"shmreplay.{instance}."))


def anon_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def table_bytes(server, client) -> int:
    return anon_rss(client.daemon_pid) + shm_bytes(server.instance)


def fill_nstep(t, n: int, seed: int = 0) -> float:
    """n transitions through an NStepWriter; returns inserts/s."""
    t0 = time.perf_counter()
    with shmreplay.NStepWriter(t, n=N_STEP, gamma=0.99) as w:
        for i, (o, o2, done) in enumerate(Stream(seed).steps(n + N_STEP)):
            w.append(obs=o, action=i % 6, reward=1.0, next_obs=o2, terminated=done)
    t.flush()
    return n / (time.perf_counter() - t0)


def rate(sample, seconds: float) -> float:
    sample()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sample()
        n += 1
    return n / (time.perf_counter() - t0)


def part_memory(items: int) -> dict:
    with shmreplay.Server() as server, server.connect() as c:
        t = c.create_table("atari", capacity=items, fields=ATARI, frames=STACKS)
        ins = fill_nstep(t, items)
        held = table_bytes(server, c)
        st = c.stats()["tables"]["atari"]
    # a writer's lease keeps a few slots reserved (capacity/256): held is a little under ``items``
    return {"items": st["size"], "inserts_per_s": round(ins), "bytes": held,
            "bytes_per_transition": round(held / max(1, st["size"])), "gb": round(held / 1e9, 2),
            "evicted_for_frames": st["frames"]["evicted_for_frames"],
            "target_gb": 8.0, "met": held <= 8e9 and st["size"] >= 0.99 * items}


def _cpprb(items: int):
    from cpprb import ReplayBuffer
    shape = (*FRAME, DEPTH)  # cpprb stacks on the last axis
    before = anon_rss(os.getpid())
    rb = ReplayBuffer(items, {"obs": {"shape": shape, "dtype": np.uint8}, "act": {"dtype": np.int64},
                              "rew": {}, "done": {}}, next_of="obs", stack_compress="obs")
    for o, o2, done in Stream(0).steps(items):
        rb.add(obs=np.moveaxis(o, 0, -1), next_obs=np.moveaxis(o2, 0, -1), act=0, rew=1.0, done=done)
        if done:
            rb.on_episode_end()
    return rb, anon_rss(os.getpid()) - before


def part_rates(items: int, seconds: float, rounds: int) -> dict:
    out: dict = {}
    rb, cp_bytes = _cpprb(items)
    with shmreplay.Server() as server, server.connect() as c:
        # a table's segments are allocated whole when it is made: measured from before
        before = table_bytes(server, c)
        fr = c.create_table("frames", capacity=items, fields=ATARI, frames=STACKS)
        out["frames_inserts_per_s"] = round(fill_nstep(fr, items))
        fr_bytes = table_bytes(server, c) - before
        before = table_bytes(server, c)
        rows = c.create_table("rows", capacity=items, fields=ATARI)
        out["rows_inserts_per_s"] = round(fill_nstep(rows, items))
        rows_bytes = table_bytes(server, c) - before
        out["bytes_per_transition"] = {"frames": round(fr_bytes / len(fr)), "rows": round(rows_bytes / len(rows)),
                                       "cpprb": round(cp_bytes / items)}
        for batch in (32, 256):
            got = {"frames": [], "rows": [], "cpprb": []}
            outs = {"frames": fr.sample(batch), "rows": rows.sample(batch)}
            for _ in range(rounds):
                got["frames"].append(rate(lambda: fr.sample(batch, out=outs["frames"]), seconds))
                got["rows"].append(rate(lambda: rows.sample(batch, out=outs["rows"]), seconds))
                got["cpprb"].append(rate(lambda: rb.sample(batch), seconds))
            med = {k: statistics.median(v) for k, v in got.items()}
            out[f"batch{batch}"] = {**{f"{k}_batches_per_s": round(v, 1) for k, v in med.items()},
                                    "rounds": {k: [round(x, 1) for x in v] for k, v in got.items()},
                                    "frames_over_rows": round(med["frames"] / med["rows"], 3),
                                    "frames_over_cpprb": round(med["frames"] / med["cpprb"], 3),
                                    "target": 0.70, "met": med["frames"] >= 0.70 * med["rows"]}
    del rb
    gc.collect()
    return out


def fill_sequences(t, sequences: int, seed: int = 1) -> float:
    stream = Stream(seed)
    steps = sequences * SEQ_PERIOD + SEQ_LEN
    t0 = time.perf_counter()
    with shmreplay.SequenceWriter(t, length=SEQ_LEN, period=SEQ_PERIOD) as w:
        for s in range(steps):
            w.append(obs=stream.frame(s))
            if s % EPISODE == EPISODE - 1:
                w.end_episode()
    t.flush()
    return len(t) / (time.perf_counter() - t0)


def part_r2d2(sequences: int, seconds: float, rounds: int) -> dict:
    out = {}
    with shmreplay.Server() as server, server.connect() as c:
        got = {}
        for kind, extra in (("frames", {"frames": {"obs": SEQ_LEN}, "frames_per_item": SEQ_PERIOD}),
                            ("rows", {})):
            before = table_bytes(server, c)
            t = c.create_table(kind, capacity=sequences, fields=R2D2, **extra)
            out[f"{kind}_sequences_per_s_in"] = round(fill_sequences(t, sequences), 1)
            out[f"{kind}_bytes_per_sequence"] = round((table_bytes(server, c) - before) / len(t))
            got[kind] = t
        rates = {k: [] for k in got}
        outs = {k: t.sample(64) for k, t in got.items()}
        for _ in range(rounds):
            for k, t in got.items():
                rates[k].append(64 * rate(lambda: t.sample(64, out=outs[k]), seconds))
    out["sequences_per_s_sampled"] = {k: round(statistics.median(v)) for k, v in rates.items()}
    out["frames_over_rows_bytes"] = round(out["frames_bytes_per_sequence"] / out["rows_bytes_per_sequence"], 3)
    out["target"] = 0.55
    out["met"] = out["frames_over_rows_bytes"] <= 0.55
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--rate-items", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--r2d2", type=int, default=2000, help="sequences (0: skip)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a)}
    report["memory"] = part_memory(a.items) if a.items else None
    print("memory", json.dumps(report["memory"]), flush=True)
    report["rates"] = part_rates(a.rate_items, a.seconds, a.rounds)
    print("rates", json.dumps(report["rates"]), flush=True)
    report["r2d2"] = part_r2d2(a.r2d2, a.seconds, a.rounds) if a.r2d2 else None
    print("r2d2", json.dumps(report["r2d2"]), flush=True)
    m, r, q = report["memory"], report["rates"], report["r2d2"]
    lines = ["", "| | frames | rows | cpprb stack_compress |", "|---|---:|---:|---:|"]
    b = r["bytes_per_transition"]
    lines.append(f"| bytes a DQN transition ({a.rate_items:,} items) | {b['frames']:,} | {b['rows']:,} | {b['cpprb']:,} |")
    for batch in (32, 256):
        x = r[f"batch{batch}"]
        lines.append(f"| batches/s, batch {batch} | {x['frames_batches_per_s']:,} | {x['rows_batches_per_s']:,} | "
                     f"{x['cpprb_batches_per_s']:,} |")
    lines.append(f"| inserts/s (n-step {N_STEP}) | {r['frames_inserts_per_s']:,} | {r['rows_inserts_per_s']:,} | |")
    if m:
        lines.append(f"\n{m['items']:,} transitions as frames: {m['gb']} GB ({m['bytes_per_transition']:,} bytes "
                     f"each; target <= 8 GB: {'met' if m['met'] else 'NOT met'})")
    for batch in (32, 256):
        x = r[f"batch{batch}"]
        lines.append(f"batch {batch}: frames {x['frames_over_rows']:.2f}x rows (target >= 0.70: "
                     f"{'met' if x['met'] else 'NOT met'}), {x['frames_over_cpprb']:.2f}x cpprb")
    if q:
        lines.append(f"R2D2 ({a.r2d2:,} sequences of {SEQ_LEN} every {SEQ_PERIOD}): frames "
                     f"{q['frames_bytes_per_sequence']:,} vs rows {q['rows_bytes_per_sequence']:,} bytes a "
                     f"sequence, {q['frames_over_rows_bytes']:.3f}x (target <= 0.55: {'met' if q['met'] else 'NOT met'}); "
                     f"sampled {q['sequences_per_s_sampled']} sequences/s")
    print("\n".join(lines))
    print(f"wrote {results.write(report, 'frames', a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
