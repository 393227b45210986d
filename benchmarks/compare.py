#!/usr/bin/env python3
"""Before/after: the same benchmark cells on two versions of shmreplay, in one run.

    python3 benchmarks/compare.py --before 443e0be [--cells insert1,insert64,sample,mp2]
        [--workloads sac-mujoco,dqn-atari] [--repeats 3] [--capacity N] [--peer cpprb]

The ``--before`` revision is exported (``git archive``) into a temporary
directory; each cell then runs as its own process (``python -m
shmreplay.bench.cells``, as benchmarks/run.py does) with that tree or this
one first on the import path, alternating which side goes first, so both
see the same machine at nearly the same time.  Both sides run this tree's
harness (``shmreplay/bench`` replaces the exported one, files and all), so
a cell added or fixed since runs the same on both; it starts each side's
daemon through that side's ``shmreplay.Server`` at the same nice, whether
or not that Server takes ``preexec`` (peers.Daemon), so any revision from
217752b on compares.  ``--peer`` adds a third
column, that peer's run of each cell in the same rounds; ``--capacity``
overrides the workloads' (the 1,000-item table of issue 22).  Prints the median of each
metric per side and after/before; writes every run to
benchmarks/results/compare-<time>.json.  Not a test: speed is reported,
never asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from shmreplay.bench import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout: the "after" side
METRICS = ("items_per_s", "batches_per_s", "inserts_per_s", "median_us")  # median_us: lower is better


def export(rev: str, into: str) -> str:
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into


def run_cell(tree: str, cell: str, workload: str, seconds: float, timeout: float = 300,
             peer: str = "shmreplay", capacity: int | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "shmreplay.bench.cells", cell, peer, workload,
           "--seconds", str(seconds)] + (["--capacity", str(capacity)] if capacity else [])
    out = runner.run_group(cmd, timeout, cwd=tree, env=env)  # a hung cell leaves nothing
    if out is None:
        return {"error": f"timed out after {timeout} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-500:] or f"exit code {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision to compare against")
    ap.add_argument("--cells", default="insert1,insert64,sample,mp2")
    ap.add_argument("--workloads", default="sac-mujoco,dqn-atari")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="per single-client cell")
    ap.add_argument("--mp-seconds", type=float, default=10.0, help="per multiprocess cell")
    ap.add_argument("--capacity", type=int, help="items per table, instead of the workload's")
    ap.add_argument("--peer", help="also run this peer (e.g. cpprb) in every round")
    a = ap.parse_args(argv)
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="shmreplay-before-") as tmp:
        trees = {"before": export(a.before, tmp), "after": ROOT}
        bench = os.path.join(tmp, "shmreplay", "bench")
        shutil.rmtree(bench, ignore_errors=True)
        shutil.copytree(os.path.join(ROOT, "shmreplay", "bench"), bench,
                        ignore=shutil.ignore_patterns("__pycache__"))
        if a.peer:
            trees[a.peer] = ROOT
        for rep in range(a.repeats):
            for w in a.workloads.split(","):
                for cell in a.cells.split(","):
                    sides = ("before", "after") if rep % 2 == 0 else ("after", "before")
                    for side in sides + ((a.peer,) if a.peer else ()):
                        secs = a.mp_seconds if "mp" in cell else a.seconds
                        r = run_cell(trees[side], cell, w, secs, capacity=a.capacity,
                                     peer=side if side == a.peer else "shmreplay")
                        runs.setdefault((w, cell), {}).setdefault(side, []).append(r)
                        vals = {m: round(r[m]) for m in METRICS if m in r}
                        print(f"  [{rep + 1}/{a.repeats}] {w:<11} {cell:<9} {side:<6} "
                              f"{vals or r.get('error')}", flush=True)
    print(f"\nbefore = {a.before}, after = working tree; medians of {a.repeats} runs each\n")
    peer = a.peer
    print("| workload | cell | metric | before | after | after/before |"
          + (f" {peer} | after/{peer} |" if peer else ""))
    print("|---|---|---|---:|---:|---:|" + ("---:|---:|" if peer else ""))
    for (w, cell), sides in runs.items():
        for m in METRICS:
            b = [r[m] for r in sides["before"] if m in r]
            f = [r[m] for r in sides["after"] if m in r]
            if b and f:
                mb, mf = statistics.median(b), statistics.median(f)
                line = f"| {w} | {cell} | {m} | {mb:,.0f} | {mf:,.0f} | {mf / mb:.2f} |"
                p = [r[m] for r in sides.get(peer, []) if m in r] if peer else []
                if p:
                    mp_ = statistics.median(p)
                    line += f" {mp_:,.0f} | {mf / mp_:.2f} |"
                print(line)
    out = os.path.join(ROOT, "benchmarks", "results", time.strftime("compare-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"before": a.before, "peer": a.peer, "capacity": a.capacity, "runs": [{"workload": w, "cell": c, **sides}
                                                for (w, c), sides in runs.items()]}, f, indent=1)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
