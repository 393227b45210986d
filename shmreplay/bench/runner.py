"""Run cells in separate processes and print them side by side.

Each cell is ``python -m shmreplay.bench.cells ...`` in its own process, so
one buffer is alive at a time and no cell inherits another's page cache
mappings or threads; a peer that lives in its own venv (peerenv.py) runs
its cells under that venv's python, the result coming back as a JSON line
on the pipe.  Ratios are shmreplay / best peer of the same run.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time

from . import peerenv

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


def run_group(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess | None:
    """Run a cell's process in a session of its own; None if it ran past
    ``timeout``.  Then the whole session (the cell, its private daemon,
    its actors) gets SIGTERM, so the daemon unlinks its segments, and
    SIGKILL 10 s later: a cell that hangs leaves no process or segment."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_cell(cell: str, peer: str, workload: str, seconds: float, timeout: float = 180,
             capacity: int | None = None) -> dict:
    """One cell in its own process: this interpreter for shmreplay, cpprb
    and numpy's ceilings, the peer's venv python for the others."""
    head = peerenv.command(peer) if peer in peerenv.SPECS else [sys.executable, "-m", "shmreplay.bench.cells"]
    cmd = head + [cell, peer, workload, "--seconds", str(seconds)]
    if capacity:
        cmd += ["--capacity", str(capacity)]
    if peer in peerenv.SPECS and peerenv.SPECS[peer].env is not None:
        timeout = max(timeout, 900)  # Reverb fills 1M items at ~5,000 items/s
    t0 = time.monotonic()
    out = run_group(cmd, timeout, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if out is None:  # cpprb's multiprocess buffer has deadlocked here once
        return {"cell": cell, "peer": peer, "workload": workload, "error": f"timed out after {timeout} s"}
    lines = [line for line in out.stdout.strip().splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"cell": cell, "peer": peer, "workload": workload,
                "error": out.stderr.strip()[-2000:] or f"exit code {out.returncode}"}
    res = json.loads(lines[-1])
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def run(quick: bool = False, seconds: float | None = None, mp_seconds: float | None = None,
        only: list[str] | None = None, log=print, capacity: int | None = None) -> dict:
    """Every cell of the plan for shmreplay and each library that works
    here; `capacity` (smoke runs) replaces every workload's."""
    plan = QUICK if quick else FULL
    seconds = seconds or (1.0 if quick else 3.0)
    mp_seconds = mp_seconds or (3.0 if quick else 10.0)
    status = {}
    for name in peerenv.SPECS:
        status[name] = peerenv.probe(name)
        if "missing" in status[name]:
            log(f"  {name}: not run: {status[name]['missing']}")
    libs = [n for n, st in status.items() if "missing" not in st]
    results = []
    results.append(run_cell("copy", "numpy", "-", seconds))
    for wkey, cells in plan.items():
        if only and wkey not in only:
            continue
        results.append(run_cell("gather", "numpy", wkey, seconds, capacity=capacity))
        results.append(run_cell("write", "numpy", wkey, seconds, capacity=capacity))
        for cell in cells:
            for lib in libs:
                why = peerenv.SPECS[lib].no_multiprocess
                if cell.startswith("mp") and why:
                    r = {"cell": cell, "peer": lib, "workload": wkey, "na": why}
                else:
                    r = run_cell(cell, lib, wkey, mp_seconds if cell.startswith("mp") else seconds,
                                 capacity=capacity)
                results.append(r)
                log(_line(r))
    if not quick:
        for cell, wkey in SHMREPLAY_ONLY:
            r = run_cell(cell, "shmreplay", wkey, seconds, capacity=capacity)
            results.append(r)
            log(_line(r))
    return {"machine": machine(), "peers": libs, "peer_status": status, "quick": quick, "results": results,
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
    try:
        info["cpprb"] = metadata.version("cpprb")
    except metadata.PackageNotFoundError:
        pass
    return info  # the other peers' versions: report["peer_status"]


def _line(r: dict) -> str:
    if "error" in r:
        last = (r["error"].strip().splitlines() or ["(no output)"])[-1]
        return f"  {r['workload']:<11} {r['cell']:<10} {r['peer']:<10} ERROR {last}"
    if "na" in r:
        return f"  {r['workload']:<11} {r['cell']:<10} {r['peer']:<10} n/a: {r['na']}"
    vals = {k: v for k, v in r.items() if k not in ("cell", "peer", "workload", "wall_s")}
    return f"  {r['workload']:<11} {r['cell']:<10} {r['peer']:<10} " + "  ".join(
        f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in vals.items())


METRICS = ("items_per_s", "batches_per_s", "inserts_per_s", "median_us", "core_fraction_at_1k_inserts")


def table(report: dict) -> str:
    """Markdown table: one row per (workload, cell, metric), a column per
    library of the suite (a peer that could not run says why below the
    table, a cell it has no mode for says n/a, a failed cell says error),
    and shmreplay / best peer."""
    allres = report["results"]
    status = report.get("peer_status") or {}
    names = [n for n in peerenv.SPECS if n != "shmreplay"]
    names += sorted({r["peer"] for r in allres} - set(names) - {"shmreplay", "numpy"})
    res = [r for r in allres if "error" not in r and "na" not in r]
    ceilings = {(r["workload"], r["cell"]): r for r in res if r["peer"] == "numpy"}
    rows, seen, notes = [], [], []
    for r in allres:
        key = (r["workload"], r["cell"])
        if r["peer"] == "numpy" or key in seen:
            continue
        seen.append(key)
        peer_cell = PEER_CELL.get(key[1], key[1])
        same = {x["peer"]: x for x in allres if (x["workload"], x["cell"]) == key}
        same.update({x["peer"]: x for x in allres
                     if (x["workload"], x["cell"]) == (key[0], peer_cell) and x["peer"] != "shmreplay"})
        metrics = [m for m in METRICS if any(m in x for x in same.values())]
        for m in metrics:
            mine = same.get("shmreplay", {}).get(m)
            others = {p: x[m] for p, x in same.items() if p != "shmreplay" and m in x}
            best = max(others.values()) if others else None
            ratio = f"{mine / best:.2f}x" if mine and best else ""
            cols = []
            for p in names:
                x = same.get(p)
                if x is None:
                    cols.append("not run" if "missing" in status.get(p, {}) else "")
                elif "na" in x:
                    cols.append("n/a")
                elif "error" in x:
                    cols.append("error")
                else:
                    cols.append(_fmt(x.get(m)) + ("*" if "capacity" in x else ""))
            star = "*" if "capacity" in same.get("shmreplay", {}) else ""
            rows.append(f"| {key[0]} | {key[1]} | {m} | {_fmt(mine)}{star} | " + " | ".join(cols)
                        + f" | {ratio} |")
    lines = ["| workload | cell | metric | shmreplay | " + " | ".join(names) + " | shmreplay / best peer |",
             "|---|---|---|---:|" + "---:|" * len(names) + "---:|"] + rows
    for name, st in status.items():
        if "missing" in st:
            notes.append(f"{name}: not run: {st['missing']}")
        elif name in peerenv.SPECS:
            notes.append(f"{name}: " + ", ".join(f"{d} {v}" for d, v in st.get("versions", {}).items())
                         + f"; {peerenv.SPECS[name].layout}")
    na, reduced = {}, {}
    for x in allres:
        if "na" in x:
            na[x["peer"]] = x["na"]
        if "error" in x:
            notes.append(f"error: {x['workload']} {x['cell']} {x['peer']}: "
                         + (x["error"].strip().splitlines() or ["?"])[-1][:300])
        if "capacity" in x:
            reduced.setdefault(x["capacity"], set()).add(x["workload"])
    notes += [f"n/a: {p}: {why}" for p, why in na.items()]
    notes += [f"*: capacity {c:,} instead of the workload's ({', '.join(sorted(ws))})" for c, ws in reduced.items()]
    lines += [""] + [f"- {n}" for n in notes]
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
