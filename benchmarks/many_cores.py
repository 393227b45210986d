#!/usr/bin/env python3
"""Issue 36, item 6: the learner cells on a machine with many cores, shmreplay
and cpprb in the same run.

    python3 benchmarks/many_cores.py [--repeats 2] [--seconds 3] [--mp-seconds 8]
        [--actors 2,8,12] [--small-actors 4,8,12] [--out FILE]

Cells (shmreplay.bench.cells, each in its own process, the two libraries
alternating which goes first in each round):

* ``sample`` on sac-mujoco and dqn-atari: prioritized sample(256) with data
  and weights, then update_priorities; batches/s.
* ``mpN`` on dqn-atari for each N of ``--actors``: N actor processes
  inserting chunks of 16 flat out while one learner samples and updates;
  the learner's batches/s and the actors' inserts/s.
* ``mpN`` on a 1,000-item dqn-atari table for each N of ``--small-actors``
  (the small table of issue 22, where the daemon's per-insert work shows).

The drop-in loop is benchmarks/dropin.py, run beside this one.  Each
result is appended to ``--out`` as one JSON line as soon as it exists, so a
run cut short keeps what it measured.  Prints a table of medians and
shmreplay/cpprb ratios last.  Not a test: speed is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from shmreplay.bench import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEERS = ("shmreplay", "cpprb")
SMALL = 1_000  # items: issue 22's small dqn table


def plan(actors: list[int], small_actors: list[int]) -> list[tuple[str, str, int | None]]:
    cells = [("sample", "sac-mujoco", None), ("sample", "dqn-atari", None)]
    cells += [(f"mp{n}", "dqn-atari", None) for n in actors]
    cells += [(f"mp{n}", "dqn-atari", SMALL) for n in small_actors]
    return cells


def medians(rows: list[dict]) -> dict:
    keys = ("batches_per_s", "inserts_per_s")
    return {k: statistics.median(r[k] for r in rows) for k in keys if rows and all(k in r for r in rows)}


def table(results: list[dict]) -> str:
    lines = ["| cell | workload | metric | shmreplay | cpprb | shmreplay / cpprb |", "|---|---|---|---:|---:|---:|"]
    seen = []
    for r in results:
        key = (r["cell"], r["workload"], r.get("capacity"))
        if key not in seen:
            seen.append(key)
    for cell, wkey, cap in seen:
        got = {p: medians([r for r in results if (r["cell"], r["workload"], r.get("capacity")) == (cell, wkey, cap)
                           and r["peer"] == p and "error" not in r]) for p in PEERS}
        label = wkey + (f" ({cap:,} items)" if cap else "")
        for metric in ("batches_per_s", "inserts_per_s"):
            if metric not in got["shmreplay"] and metric not in got["cpprb"]:
                continue
            ours, theirs = got["shmreplay"].get(metric), got["cpprb"].get(metric)
            ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
            fmt = (lambda v: f"{v:,.0f}" if v is not None else "error")
            lines.append(f"| {cell} | {label} | {metric} | {fmt(ours)} | {fmt(theirs)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0, help="per sample cell")
    ap.add_argument("--mp-seconds", type=float, default=8.0, help="per multiprocess cell")
    ap.add_argument("--actors", default="2,8,12")
    ap.add_argument("--small-actors", default="4,8,12")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  time.strftime("many-cores-%Y%m%d-%H%M%S.jsonl")))
    a = ap.parse_args(argv)
    ints = (lambda s: [int(x) for x in s.split(",") if x])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "a") as f:
        f.write(json.dumps({"machine": runner.machine(), "cpus": os.cpu_count(),
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    results = []
    for rep in range(a.repeats):
        for cell, wkey, cap in plan(ints(a.actors), ints(a.small_actors)):
            for peer in (PEERS if rep % 2 == 0 else PEERS[::-1]):
                secs = a.mp_seconds if cell.startswith("mp") else a.seconds
                r = runner.run_cell(cell, peer, wkey, secs, capacity=cap)
                r.setdefault("capacity", cap)
                results.append(r)
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
                shown = {k: round(v) for k, v in r.items() if k.endswith("_per_s")}
                print(f"  round {rep} {cell:<6} {wkey:<10} {cap or '':<5} {peer:<9} "
                      f"{r.get('error', '').strip().splitlines()[-1:] or shown}", flush=True)
    print(f"\n{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}; medians of "
          f"{a.repeats} rounds\n")
    print(table(results))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
