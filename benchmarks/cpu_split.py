#!/usr/bin/env python3
"""Who uses the CPU while a benchmark cell runs: each process's share of a
core, read from /proc over a window in the middle of the cell (issue 36,
item 3: where a small table's inserts go).

    python3 benchmarks/cpu_split.py [--start 6] [--window 5] -- CELL PEER WORKLOAD [cell options]

runs ``python3 -m shmreplay.bench.cells CELL PEER WORKLOAD ...`` and, from
``--start`` seconds after its start for ``--window`` seconds, adds up
every process's user + system CPU (all its threads) that started from it
(its children, the daemon a ``Server`` starts, spawned actors), by pid,
named by its command line.  Prints a line per process (share of a core),
the total, and the cell's own output line.  The cell must run longer than
start + window (``--seconds``).  Linux only; not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def family(root: int) -> set[int]:
    """``root`` and every process descended from it, now."""
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                st = open(f"/proc/{p}/stat").read()
                parent[int(p)] = int(st[st.rfind(")") + 2:].split()[1])
            except OSError:
                continue
    out, grew = {root}, True
    while grew:
        grew = False
        for pid, pp in parent.items():
            if pp in out and pid not in out:
                out.add(pid)
                grew = True
    return out


def ticks(pids) -> dict[int, tuple[str, int]]:
    """pid -> (command line, user + system ticks of all its threads)."""
    out = {}
    for pid in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            st = open(f"/proc/{pid}/stat").read()
            f = st[st.rfind(")") + 2:].split()
            out[pid] = (cmd.strip(), int(f[11]) + int(f[12]))
        except OSError:
            continue
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=float, default=6.0)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("cell", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cell = [x for x in a.cell if x != "--"]
    proc = subprocess.Popen([sys.executable, "-m", "shmreplay.bench.cells", *cell],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(a.start)
    before, t0 = ticks(family(proc.pid)), time.perf_counter()
    time.sleep(a.window)
    after, dt = ticks(family(proc.pid)), time.perf_counter() - t0
    total = 0.0
    rows = []
    for pid, (cmd, t) in after.items():
        if pid in before:
            share = (t - before[pid][1]) / TICK / dt
            total += share
            rows.append((share, pid, cmd))
    for share, pid, cmd in sorted(rows, reverse=True):
        if share >= 0.005:
            print(f"{share:5.2f} core  pid {pid}  {cmd[:100]}")
    print(f"{total:5.2f} core  in all")
    out = proc.communicate()[0]
    print(out.strip().splitlines()[-1] if out.strip() else "(the cell printed nothing)")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
