#!/usr/bin/env python3
"""The drop-in loop's two calls alone (issue 36, item 1): the per-call cost of
``add`` and ``sample(128)`` on the SB3-style numpy buffer and on shmreplay,
without the env or torch's updates around them, and how much of shmreplay's
is the client's own Python work.

    python3 benchmarks/dropin_calls.py [--calls 20000] [--rounds 3] [--profile]

Both buffers are ``benchmarks/dropin.py``'s (same constructor, ``add``,
``sample``, the tensors included), filled with 10,000 CartPole-sized
transitions, then timed in alternating rounds: ``--calls`` adds, then
``--calls``/10 samples.  Each call is timed in wall time and in the
thread's CPU time (what a loaded box's other processes do not add to); for
shmreplay also the CPU time its calls spend in ``CommandPipe.wait`` (the
spin before sleeping for the daemon's reply) and in ringing the daemon's
doorbell (an eventfd write, which wakes it): what is left is the client's
own work.  The probes cost ~1 us a wait or ring.  ``--profile``: a cProfile of shmreplay's calls after the
rounds (its overhead inflates small functions; read it for shares).
Prints medians per call over rounds.  Speed is reported, never asserted.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import numpy as np

from dropin import BUFFERS, CAPACITY  # beside this file: the script's folder is on the path

from shmreplay.client import pipe as pipemod

OBS = (4,)


class Clock:
    """Wraps a function to add up the thread CPU nanoseconds spent in it."""

    def __init__(self, inner):
        self.ns = 0

        def timed(*args, **kwargs):
            t = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - t
        self.fn = timed


def per_call(fn, rb, arg, calls: int) -> tuple[float, float]:
    """(wall us, thread CPU us) per call of ``fn(rb, arg)``."""
    c, t = time.thread_time_ns(), time.perf_counter_ns()
    fn(rb, arg)
    return (time.perf_counter_ns() - t) / calls / 1e3, (time.thread_time_ns() - c) / calls / 1e3


def transitions(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n + 1, *OBS)).astype(np.float32)
    acts = rng.integers(0, 2, n)
    return [(obs[i], obs[i + 1], int(acts[i]), 1.0, bool(i % 50 == 49)) for i in range(n)]


def adds(rb, trs) -> None:
    for tr in trs:
        rb.add(*tr)


def samples(rb, k: int) -> None:
    for _ in range(k):
        rb.sample(128)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000, help="adds per round (samples: a tenth)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile shmreplay's calls after the rounds")
    a = ap.parse_args(argv)
    import torch  # noqa: F401  (imported by the buffers' sample; not in the first round's time)
    trs = transitions(max(a.calls, CAPACITY))
    bufs = {name: cls(CAPACITY, OBS) for name, cls in BUFFERS.items()}
    res: dict = {name: {c + part: [] for c in ("add", "sample") for part in ("", "_cpu", "_wait", "_bell")}
                 for name in bufs}
    try:
        shm = bufs["shmreplay"]
        # a benchmark's probes: the pipe's waits, and the doorbells it rings (eventfd writes);
        # the SB3 buffer never calls either
        clock = Clock(pipemod.CommandPipe.wait)
        pipemod.CommandPipe.wait = clock.fn
        bells = Clock(pipemod.ring_bell)
        pipemod.ring_bell = bells.fn
        for rb in bufs.values():
            adds(rb, trs[:CAPACITY])
        shm.table.flush()
        k = max(1, a.calls // 10)
        for rep in range(a.rounds):
            for name in (list(bufs) if rep % 2 == 0 else list(bufs)[::-1]):
                rb = bufs[name]
                for call, fn, arg, calls in (("add", adds, trs[:a.calls], a.calls), ("sample", samples, k, k)):
                    w0, b0 = clock.ns, bells.ns
                    wall, cpu = per_call(fn, rb, arg, calls)
                    res[name][call].append(wall)
                    res[name][call + "_cpu"].append(cpu)
                    res[name][call + "_wait"].append((clock.ns - w0) / calls / 1e3 if rb is shm else 0.0)
                    res[name][call + "_bell"].append((bells.ns - b0) / calls / 1e3 if rb is shm else 0.0)
        load = os.getloadavg()[0]
        print(f"{a.calls:,} adds and {k:,} samples of 128 per round, {a.rounds} rounds, "
              f"load average {load:.2f}; medians per call (us)\n")
        print("| call | sb3 wall | shmreplay wall | sb3 CPU | shmreplay CPU | in waits | in doorbells "
              "| client's own work | own/sb3 CPU |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for call in ("add", "sample"):
            m = {(b, part): statistics.median(res[b][call + part]) for b in bufs for part in ("", "_cpu", "_wait", "_bell")}
            own = m["shmreplay", "_cpu"] - m["shmreplay", "_wait"] - m["shmreplay", "_bell"]
            label = "add" if call == "add" else "sample(128)"
            print(f"| {label} | {m['sb3', '']:.1f} | {m['shmreplay', '']:.1f} | {m['sb3', '_cpu']:.1f} "
                  f"| {m['shmreplay', '_cpu']:.1f} | {m['shmreplay', '_wait']:.1f} | {m['shmreplay', '_bell']:.1f} "
                  f"| {own:.1f} | {own / m['sb3', '_cpu']:.2f}x |")
        if a.profile:
            for call, fn, arg in (("add", adds, trs[:a.calls]), ("sample(128)", samples, k)):
                prof = cProfile.Profile()
                prof.enable()
                fn(shm, arg)
                prof.disable()
                print(f"\n---- cProfile of shmreplay's {call} ----")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        for rb in bufs.values():
            rb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
