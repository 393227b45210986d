#!/usr/bin/env python3
"""Tables larger than RAM: rows in a file on disk, side by side (issue 14, item 5).

    python3 benchmarks/capacity.py [--quick] [--no-seed-row] [--gib 8] [--dir /var/tmp]

One invocation, on dqn-atari rows (28,233 bytes), cold = page cache dropped
(``echo 3 > /proc/sys/vm/drop_caches``; needs root, else the numbers are
marked not cold):

* the disk's own random-read ceiling for the row size, one ``preadv`` at a
  time and 16 threads at a time, and POSIX_FADV_WILLNEED from one thread;
* a plain ``np.memmap`` gather of random batches (a page fault at a time),
  with the kernel's read-ahead and with MADV_RANDOM;
* TorchRL's LazyMemmapStorage with a RandomSampler, where torchrl imports;
* shmreplay: a file-backed table sampled through ``iterate(prefetch=2)``
  with the daemon's prefetch by ``preadv`` threads, by WILLNEED, and off,
  cold and warm, and plain ``sample``;
* the DQN Atari seed row at full size (400,000 x 110 KB, 45 GB: larger
  than this box's 24 GiB), actors at 420 items/s and a prioritized learner;
  ``--quick``: 8,000 items (0.9 GB) in the memory cgroup.  The table and
  its file are removed after.

Cold cells read a fifth of the file's rows, each once.  Prints a table and
the targets, writes JSON to benchmarks/results/capacity-<time>.json.  Speed
is reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from harness import disk, seedrow
from shmreplay.bench import runner

W = disk.DQN
BATCH = 256
TARGETS = """targets (issue 14): cold prefetched sampling >= 80% of the 16-deep read ceiling and
>= 2x the plain memmap gather; the DQN Atari seed row at >= 400 inserts/s and 1,650 samples/s."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 GiB of rows, short cells, an 8,000-item seed row")
    ap.add_argument("--gib", type=float, help="size of the rows file (default 8, --quick 1)")
    ap.add_argument("--mem-limit-mib", type=int,
                    help="memory cgroup of the reading processes (default a quarter of the file, "
                         "at least 512; 0: none)")
    ap.add_argument("--seconds", type=float, help="longest a cell runs (default 20, --quick 5)")
    ap.add_argument("--no-seed-row", dest="seed_row", action="store_false", help="skip the seed row")
    ap.add_argument("--seed-capacity", type=int, help="items in the seed row (default 400,000, --quick 8,000)")
    ap.add_argument("--seed-seconds", type=float, help="how long the seed row samples (default 60, --quick 10)")
    ap.add_argument("--dir", default="/var/tmp", help="where the files go (a local disk, not tmpfs)")
    ap.add_argument("--out", help="JSON file (default benchmarks/results/capacity-<time>.json)")
    a = ap.parse_args(argv)
    gib = a.gib or (1.0 if a.quick else 8.0)
    seconds = a.seconds or (5.0 if a.quick else 20.0)
    rows = int(gib * 2**30) // W.item_bytes
    cold_rows = rows // 5
    limit = (a.mem_limit_mib if a.mem_limit_mib is not None else max(512, int(gib * 1024) // 4)) << 20
    cg = disk.MemoryCgroup.make(limit) if limit else None
    work = tempfile.mkdtemp(prefix="shmr-capacity-", dir=a.dir)
    store = os.path.join(work, "tables")
    report = {"machine": runner.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": a.quick,
              "rows": rows, "row_bytes": W.item_bytes, "file_GB": rows * W.item_bytes / 1e9,
              "cold_rows": cold_rows, "batch": BATCH, "memory_cgroup_MiB": (limit >> 20) if cg else None,
              "results": {}}
    res = report["results"]
    print(f"cold cells run in a memory cgroup of {limit >> 20} MiB" if cg else
          "no memory cgroup: cold cells may find rows the read-ahead brought in", flush=True)

    def cell(name, fn, *args, cold=True):
        """A cell in a child process; cold: page cache dropped, in the cgroup."""
        dropped = disk.drop_caches() if cold else None
        r = disk.in_child(fn, *args, cgroup=cg if cold else None)
        if cold:
            r["cold"] = bool(dropped and r.get("cold", True))
        return show(name, r)

    def show(name, r):
        res[name] = r
        print(f"  {name:<40} " + "  ".join(f"{k} {v:,.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in r.items()), flush=True)
        return r

    daemon = disk.BenchDaemon(store)
    try:
        path = os.path.join(work, "rows.bin")
        t0 = time.monotonic()
        disk.make_rows_file(path, rows, W.item_bytes)
        print(f"{rows:,} rows of {W.item_bytes:,} bytes ({gib:g} GiB) written in {time.monotonic() - t0:.0f} s; "
              f"cold cells read {cold_rows:,} of them", flush=True)
        cell("disk preadv, 1 in flight", disk.ceiling, path, rows, W.item_bytes, 1, min(cold_rows, 20_000))
        cell("disk preadv, 16 in flight", disk.ceiling, path, rows, W.item_bytes, 16, cold_rows)
        cell("disk WILLNEED batches, 1 thread", disk.fadvise_batches, path, rows, W.item_bytes, cold_rows, BATCH)
        cell("np.memmap gather", disk.memmap_gather, path, rows, W.item_bytes, cold_rows // BATCH, BATCH, seconds)
        cell("np.memmap gather, MADV_RANDOM", disk.memmap_gather, path, rows, W.item_bytes,
             cold_rows // BATCH, BATCH, seconds, True)
        os.unlink(path)
        show("torchrl LazyMemmapStorage", disk.run_torchrl(rows, cold_rows // BATCH, BATCH, seconds, True, work, cg))
        os.makedirs(store, mode=0o750, exist_ok=True)
        daemon.start()
        with daemon.connect() as c:
            c.create_table("cap", capacity=rows, fields=W.fields, sampler="prioritized", alpha=0.6,
                           storage_dir=store)
        fill_s = disk.in_child(disk.fill, daemon.socket, "cap", rows)
        print(f"shmreplay table filled in {fill_s:.0f} s ({rows / fill_s:,.0f} items/s)", flush=True)
        batches = cold_rows // BATCH
        for name, threads, method, k in (("shmreplay iterate, prefetch preadv", 16, "pread", 2),
                                         ("shmreplay iterate, prefetch WILLNEED", 16, "fadvise", 2),
                                         ("shmreplay iterate, prefetch off", 0, "pread", 2),
                                         ("shmreplay sample, prefetch preadv", 16, "pread", 0),
                                         ("shmreplay sample, prefetch WILLNEED", 16, "fadvise", 0)):
            daemon.restart(threads, method, cgroup=cg)
            cell(name, disk.learn, daemon.socket, "cap", BATCH, batches, seconds, k)
        for name, threads, method in (("shmreplay iterate warm, prefetch preadv", 16, "pread"),
                                      ("shmreplay iterate warm, prefetch WILLNEED", 16, "fadvise"),
                                      ("shmreplay iterate warm, prefetch off", 0, "pread")):
            daemon.restart(threads, method)
            disk.warm(os.path.join(store, f"shmreplay.{daemon.instance}.r.cap"))
            cell(name, disk.learn, daemon.socket, "cap", BATCH, 10**9, seconds, 2, cold=False)
        with daemon.connect() as c:
            c.drop_table("cap")
        if a.seed_row:  # quick: small enough to fit, so in the cgroup; full size is larger than RAM
            method, seed_cg = best_cold(res)[2], cg if a.quick else None
            daemon.restart(16, method, cgroup=seed_cg)
            show("seed row", disk.in_child(seedrow.run, daemon, a.seed_capacity or (8_000 if a.quick else 400_000),
                                           a.seed_seconds or (20.0 if a.quick else 60.0), cgroup=seed_cg))
            res["seed row"].update(method=method, memory_cgroup=seed_cg is not None)
    finally:
        daemon.stop()
        if os.path.isdir(store) and os.listdir(store):  # a failed run: adopt and drop what is left
            daemon.start(0, retain=False)
            with daemon.connect() as c:
                for name in c.list_tables():
                    c.drop_table(name)
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
        if cg is not None:
            cg.remove()
    runner.finish(report, table(report), TARGETS, targets, a.out, os.path.dirname(os.path.abspath(__file__)),
                  "capacity-")
    return 0


def best_cold(res: dict) -> tuple[float, str, str]:
    """(rows/s, cell, prefetch method) of the fastest cold prefetched iterate cell."""
    return max(((r["rows_per_s"], n, "fadvise" if "WILLNEED" in n else "pread") for n, r in res.items()
                if n.startswith("shmreplay iterate, prefetch") and "off" not in n and "rows_per_s" in r),
               default=(0.0, "none ran", "fadvise"))


def table(report: dict) -> str:
    """One row per cell: rows/s, GB/s, and the ratios to the same run's
    16-deep ceiling and memmap gather."""
    res = report["results"]
    qd16 = res.get("disk preadv, 16 in flight", {}).get("rows_per_s")
    mm = res.get("np.memmap gather", {}).get("rows_per_s")
    lines = ["| cell | cache | rows/s | GB/s | / 16-deep ceiling | / memmap gather |", "|---|---|---:|---:|---:|---:|"]
    for name, r in res.items():
        if name == "seed row":
            continue
        if "error" in r:
            lines.append(f"| {name} | - | not run: {r['error']} | | | |")
            continue
        cache = "warm" if "warm" in name else ("cold" if r.get("cold") else "not dropped")
        v = r["rows_per_s"]
        lines.append(f"| {name} | {cache} | {v:,.0f} | {r['GB_per_s']:.3f} | "
                     f"{v / qd16:.0%} | {v / mm:.1f}x |" if qd16 and mm else f"| {name} | {cache} | {v:,.0f} | | | |")
    s = res.get("seed row")
    if s and "error" in s:
        lines.append(f"\nseed row: failed: {s['error']}")
    elif s:
        lines.append(f"\nseed row: {s['capacity']:,} x {s['item_bytes']:,} bytes ({s['GB']:.1f} GB), filled in "
                     f"{s['fill_s']:.0f} s ({s['fill_items_per_s']:,.0f} items/s); learner paced at the "
                     f"seed's 1,650 (+5%): actors {s['inserts_per_s']:,.0f} inserts/s (seed 400), learner "
                     f"{s['samples_per_s']:,.0f} samples/s; learner flat out: {s['max_samples_per_s']:,.0f} "
                     f"samples/s with actors at {s['max_inserts_per_s']:,.0f} inserts/s; "
                     f"iterate(prefetch={s['prefetch']}), prefetch by "
                     f"{s['method']}{', in the memory cgroup' if s.get('memory_cgroup') else ''}; "
                     f"file removed: {s['file_removed']}")
    return "\n".join(lines)


def targets(report: dict) -> list[str]:
    res, out = report["results"], []
    qd16 = res.get("disk preadv, 16 in flight", {}).get("rows_per_s")
    mm = res.get("np.memmap gather", {}).get("rows_per_s")
    best = best_cold(res)
    if qd16 and mm:
        out.append(f"{'PASS' if best[0] >= 0.8 * qd16 else 'MISS'} cold prefetched sampling ({best[1]}): "
                   f"{best[0] / qd16:.0%} of the 16-deep ceiling (need 80%)")
        out.append(f"{'PASS' if best[0] >= 2 * mm else 'MISS'} cold prefetched sampling: "
                   f"{best[0] / mm:.1f}x the memmap gather (need 2x)")
    s = res.get("seed row")
    if s and "error" not in s:
        for key, need, what in (("inserts_per_s", 400, "inserts"), ("samples_per_s", 1650, "samples")):
            out.append(f"{'PASS' if s[key] >= need else 'MISS'} seed row {what}: {s[key]:,.0f}/s "
                       f"(need {need:,}) at {s['capacity']:,} items, both at once, the learner "
                       "paced at the seed's rate")
    return out


if __name__ == "__main__":
    sys.exit(main())
