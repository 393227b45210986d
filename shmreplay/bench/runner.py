"""Run cells in separate processes and print them side by side.

Each cell is ``python -m shmreplay.bench.cells ...`` in its own process, so
one buffer is alive at a time and no cell inherits another's page cache
mappings or threads.  Ratios are shmreplay / best peer of the same run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

from . import peers

FULL = {
    "sac-mujoco": ["insert1", "insert64", "sample", "mp2", "mp4"],
    "dqn-atari": ["insert1", "insert64", "sample", "mp2", "mp4"],
    "r2d2-seq": ["insert1", "insert64", "sample", "mp2", "mp4"],
}
QUICK = {"sac-mujoco": ["insert64", "sample", "mp2"]}
# cells of shmreplay's own API compared with the peers' plain cell
PEER_CELL = {"sample_it": "sample"}
SHMREPLAY_ONLY = [("sample_it", "sac-mujoco"), ("sample_it", "dqn-atari"), ("sample_it", "r2d2-seq"),
                  ("rtt", "sac-mujoco"), ("daemon_cpu", "sac-mujoco")]


def run_cell(cell: str, peer: str, workload: str, seconds: float, timeout: float = 180) -> dict:
    cmd = [sys.executable, "-m", "shmreplay.bench.cells", cell, peer, workload, "--seconds", str(seconds)]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # cpprb's multiprocess buffer has deadlocked here once
        return {"cell": cell, "peer": peer, "workload": workload, "error": f"timed out after {timeout} s"}
    if out.returncode != 0:
        return {"cell": cell, "peer": peer, "workload": workload,
                "error": out.stderr.strip()[-2000:] or f"exit code {out.returncode}"}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def run(quick: bool = False, seconds: float | None = None, mp_seconds: float | None = None,
        only: list[str] | None = None, log=print) -> dict:
    plan = QUICK if quick else FULL
    seconds = seconds or (1.0 if quick else 3.0)
    mp_seconds = mp_seconds or (3.0 if quick else 10.0)
    libs = peers.available()
    results = []
    results.append(run_cell("copy", "numpy", "-", seconds))
    for wkey, cells in plan.items():
        if only and wkey not in only:
            continue
        results.append(run_cell("gather", "numpy", wkey, seconds))
        results.append(run_cell("write", "numpy", wkey, seconds))
        for cell in cells:
            for lib in libs:
                r = run_cell(cell, lib, wkey, mp_seconds if cell.startswith("mp") else seconds)
                results.append(r)
                log(_line(r))
    if not quick:
        for cell, wkey in SHMREPLAY_ONLY:
            r = run_cell(cell, "shmreplay", wkey, seconds)
            results.append(r)
            log(_line(r))
    return {"machine": machine(), "peers": libs, "quick": quick, "results": results,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def machine() -> dict:
    import numpy
    info = {"python": platform.python_version(), "numpy": numpy.__version__, "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    from importlib import metadata
    for lib in ("cpprb", "torchrl", "dm-reverb"):
        try:
            info[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            pass
    return info


def _line(r: dict) -> str:
    if "error" in r:
        last = (r["error"].strip().splitlines() or ["(no output)"])[-1]
        return f"  {r['workload']:<11} {r['cell']:<10} {r['peer']:<10} ERROR {last}"
    vals = {k: v for k, v in r.items() if k not in ("cell", "peer", "workload", "wall_s")}
    return f"  {r['workload']:<11} {r['cell']:<10} {r['peer']:<10} " + "  ".join(
        f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in vals.items())


def table(report: dict) -> str:
    """Markdown table: one row per (workload, cell), a column per peer, and
    shmreplay / best peer for each metric."""
    res = [r for r in report["results"] if "error" not in r]
    ceilings = {(r["workload"], r["cell"]): r for r in res if r["peer"] == "numpy"}
    rows, seen = [], []
    for r in res:
        key = (r["workload"], r["cell"])
        if r["peer"] == "numpy" or key in seen:
            continue
        seen.append(key)
        peer_cell = PEER_CELL.get(key[1], key[1])
        same = {x["peer"]: x for x in res if (x["workload"], x["cell"]) == key}
        same.update({x["peer"]: x for x in res
                     if (x["workload"], x["cell"]) == (key[0], peer_cell) and x["peer"] != "shmreplay"})
        metrics = [m for m in ("items_per_s", "batches_per_s", "inserts_per_s", "median_us",
                               "core_fraction_at_1k_inserts") if m in r]
        for m in metrics:
            mine = same.get("shmreplay", {}).get(m)
            others = {p: x[m] for p, x in same.items() if p != "shmreplay" and m in x}
            best = max(others.values()) if others else None
            ratio = f"{mine / best:.2f}x" if mine and best else ""
            rows.append(f"| {key[0]} | {key[1]} | {m} | {_fmt(mine)} | "
                        + " | ".join(f"{p} {_fmt(v)}" for p, v in others.items()) + f" | {ratio} |")
    lines = ["| workload | cell | metric | shmreplay | peers | shmreplay / best peer |",
             "|---|---|---|---:|---|---:|"] + rows
    for (w, c), r in sorted(ceilings.items()):
        lines.append(f"\nnumpy {c} ceiling ({w}): " + ", ".join(
            f"{k} {v:,.1f}" for k, v in r.items() if isinstance(v, float) and k != "wall_s"))
    return "\n".join(lines)


def finish(report: dict, table_text: str, targets_text: str, check, out: str | None, bench_dir: str,
           prefix: str = "") -> str:
    """A benchmark's end: print its table and its targets with the verdicts
    ``check(report)`` gives (kept in the report), and write the report as
    JSON to ``out`` (default ``bench_dir/results/<prefix><time>.json``)."""
    print("\n" + table_text + "\n\n" + targets_text)
    report["targets"] = check(report)
    print("\n".join(report["targets"]))
    out = out or os.path.join(bench_dir, "results", prefix + time.strftime("%Y%m%d-%H%M%S") + ".json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {out}")
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.3g}"
