#!/usr/bin/env python3
"""The benchmark suite: shmreplay vs cpprb, TorchRL, Reverb and Flashbax (each
peer that works here; the others are listed with the reason) on the three
workloads of shared/WORKLOADS.md, numpy's ceilings in the same run.

    pip install -e ".[bench]"        # shmreplay + cpprb; the other peers: docs/performance.md, Peers
    python benchmarks/run.py [--quick] [--workload dqn-atari] [--out FILE]

Prints a table of ratios, checks them against the targets of issue 3 and
writes everything as JSON (default benchmarks/results/<time>.json).  Not part
of the test suite: speed is reported, never asserted in tests.
"""

from __future__ import annotations

import argparse
import os
import sys

from shmreplay.bench import runner
from shmreplay.bench.workloads import WORKLOADS

TARGETS = """targets (issue 3): single-client cells >= 2x best peer; multiprocess cells >= 3x;
dqn-atari and r2d2-seq gather >= 70% of numpy's gather ceiling; sample round trip median
< 100 us with 1M items, batch 256; daemon < 10% of a core at 1,000 inserts/s, ~0% idle.
A MISS marked "beyond this machine" needs more payload bytes per second than any
cell of the run (numpy's own copies included) moved."""


def traffic_GBps(w: str, r: dict) -> float:
    """Payload bytes a cell's result moved per second (inserted plus gathered)."""
    wl = WORKLOADS[w]
    items = r.get("items_per_s", 0.0) + r.get("inserts_per_s", 0.0)
    return (items + r.get("batches_per_s", 0.0) * wl.batch) * wl.item_bytes / 1e9


def machine_GBps(res: dict) -> float:
    """The most payload traffic anything moved in this run: numpy's ceilings
    (gather on one or two threads, row writes, copyto) and every library's
    cells.  A target that needs more than this is beyond the machine."""
    best = 0.0
    for (w, c, p), r in res.items():
        best = max(best, r.get("GB_per_s", 0.0), r.get("GB_per_s_2threads", 0.0))
        if w in WORKLOADS and p != "numpy":
            best = max(best, traffic_GBps(w, r))
    return best


def _beyond(w: str, peer_rows: list, metric: str, need: float, ceiling: float) -> str:
    """' (beyond ...)' when `need` x the best peer's traffic exceeds the machine.
    Multiprocess targets hold for inserts and batches at once, so their need
    is the sum of both at `need` x the best peer."""
    if any("inserts_per_s" in x for x in peer_rows):  # a multiprocess cell
        needed = need * max(traffic_GBps(w, x) for x in peer_rows)
    else:
        needed = need * max(traffic_GBps(w, {metric: x[metric]}) for x in peer_rows)
    if needed <= ceiling:
        return ""
    return f" (beyond this machine: needs {needed:.1f} GB/s of payload traffic, the most any cell moved was {ceiling:.1f} GB/s)"


def check_targets(report: dict) -> list[str]:
    res = {(r["workload"], r["cell"], r["peer"]): r for r in report["results"] if "error" not in r}
    ceiling = machine_GBps(res)
    out = []
    for (w, c, p), r in sorted(res.items()):
        if p != "shmreplay" or c in ("rtt", "daemon_cpu"):
            continue
        need = 3.0 if c.startswith("mp") else 2.0
        peer_cell = runner.PEER_CELL.get(c, c)
        for m in ("items_per_s", "batches_per_s", "inserts_per_s"):
            peer_rows = [x for (w2, c2, p2), x in res.items()
                         if (w2, c2) == (w, peer_cell) and p2 not in (p, "numpy") and m in x]
            if m in r and peer_rows:
                ratio = r[m] / max(x[m] for x in peer_rows)
                verdict = "PASS" if ratio >= need else "MISS"
                why = _beyond(w, peer_rows, m, need, ceiling) if verdict == "MISS" else ""
                out.append(f"{verdict} {w} {c} {m}: {ratio:.2f}x (need {need}x){why}")
        if c in ("sample", "sample_it") and w in ("dqn-atari", "r2d2-seq") and (w, "gather", "numpy") in res:
            frac = r["GB_per_s"] / res[(w, "gather", "numpy")]["GB_per_s"]
            out.append(f"{'PASS' if frac >= 0.7 else 'MISS'} {w} {c}: gathered {frac:.0%} of numpy's "
                       "gather ceiling (sample+update, need 70%)")
    if ("sac-mujoco", "rtt", "shmreplay") in res:
        us = res[("sac-mujoco", "rtt", "shmreplay")]["median_us"]
        out.append(f"{'PASS' if us < 100 else 'MISS'} sample round trip median {us:.0f} us (need < 100)")
    if ("sac-mujoco", "daemon_cpu", "shmreplay") in res:
        r = res[("sac-mujoco", "daemon_cpu", "shmreplay")]
        f, idle = r["core_fraction_at_1k_inserts"], r["core_fraction_idle"]
        out.append(f"{'PASS' if f < 0.10 and idle < 0.01 else 'MISS'} daemon {f:.1%} of a core at "
                   f"{r['inserts_per_s']:.0f} inserts/s, {idle:.2%} idle")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the `shmreplay bench` subset")
    ap.add_argument("--workload", action="append", help="only these workloads")
    ap.add_argument("--seconds", type=float, help="per single-client cell (default 3)")
    ap.add_argument("--mp-seconds", type=float, help="per multiprocess cell (default 10)")
    ap.add_argument("--out", help="JSON file (default benchmarks/results/<time>.json)")
    ap.add_argument("--capacity", type=int, help="items per table instead of each workload's (smoke runs)")
    a = ap.parse_args(argv)
    report = runner.run(a.quick, a.seconds, a.mp_seconds, a.workload, log=lambda s: print(s, flush=True),
                        capacity=a.capacity)
    runner.finish(report, runner.table(report), TARGETS, check_targets, a.out,
                  os.path.dirname(os.path.abspath(__file__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
