#!/usr/bin/env python3
"""The WORKLOADS.md R2D2 row on this machine's disk (issue 37, item 5):
10,000 sequences of 80 Atari frames (210x160x3, 100,800 bytes: 100 GB as
rows) held as a file-backed frame table (each step's frame stored once:
``frames={"obs": 80}``, ``frames_per_item=40``), served at the row's rates
(3 sequences inserted and 45 sampled a second, at once) inside a memory
cgroup of 2 GiB, with every sampled sequence checked frame by frame.

    python3 benchmarks/frames_disk.py --dir /var/tmp/r2d2 [--sequences 10000]
                                      [--memory-gib 2] [--seconds 120] [--out FILE]

Needs root (it makes a cgroup: v2 under /sys/fs/cgroup, or v1's memory
controller) and about 45 GB free in ``--dir``.  This process, the daemon
it starts (``shmreplay.Server``, ``preexec`` joins the group before the
daemon's first page) and the writer and learner threads all run in the
cgroup, so the table's page cache is charged to it too.  Phases:

1. fill: one writer (``SequenceWriter``, period 40, episodes of 1,000
   steps) writes ``--sequences`` sequences as fast as it goes;
2. serve: for ``--seconds``, the writer adds 3 sequences a second while a
   learner (``iterate``, two batches drawn ahead, so the daemon's
   prefetcher reads their frames from the disk meanwhile) takes batches
   of 9 five times a second (45 sequences/s),
   each sequence checked: frame i is the stream's step start + i, stamped
   with its step number, and frames past its length are zero.

Reports sequences/s in and out, the bytes on disk (against rows), the
cgroup's peak memory, and every check.  Writes JSON (default
``benchmarks/results/frames-disk-<time>.json``).  Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np
from harness import results

import shmreplay

FRAME = (210, 160, 3)
LENGTH, PERIOD, EPISODE = 80, 40, 1000
POOL = 32


class Frames:
    """Step s's frame: a pool frame stamped with s (so every frame is its own)."""

    def __init__(self):
        self.pool = np.random.default_rng(0).integers(0, 256, (POOL, *FRAME), dtype=np.uint8)

    def __call__(self, s: int) -> np.ndarray:
        f = self.pool[s % POOL].copy()
        f.reshape(-1)[:8].view(np.int64)[0] = s
        return f

    def check(self, seq: np.ndarray, start: int, length: int) -> bool:
        """``seq`` (LENGTH frames) holds steps start.. for ``length`` steps, then zeros."""
        flat = seq.reshape(LENGTH, -1)
        steps = flat[:length, :8].copy().view(np.int64)[:, 0]
        if not np.array_equal(steps, np.arange(start, start + length)):
            return False
        for i in range(length):
            if not np.array_equal(flat[i, 8:], self.pool[(start + i) % POOL].reshape(-1)[8:]):
                return False
        return not flat[length:].any()


class Cgroup:
    """A memory cgroup of ``limit`` bytes (v2 if mounted, else v1's memory controller)."""

    def __init__(self, limit: int):
        name = f"shmreplay-frames-{os.getpid()}"
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.path, self.limit_file, self.peak_file = f"/sys/fs/cgroup/{name}", "memory.max", "memory.peak"
        else:
            self.path = f"/sys/fs/cgroup/memory/{name}"
            self.limit_file, self.peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
        os.mkdir(self.path)
        self._write(self.limit_file, str(limit))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def join(self, pid: int = 0) -> None:
        self._write("cgroup.procs", str(pid or os.getpid()))

    def peak(self) -> int | None:
        try:
            with open(os.path.join(self.path, self.peak_file)) as f:
                return int(f.read())
        except OSError:
            return None

    def remove(self) -> None:
        parent = os.path.dirname(self.path)
        with open(os.path.join(parent, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(self.path)


def fill(t, frames: Frames, sequences: int) -> tuple[int, float]:
    """The writer's fill: returns (steps written, seconds)."""
    t0 = time.perf_counter()
    s = 0
    # a durable table keeps its sync headroom evicted ahead (slots/barrier.py):
    # counted by sequences committed, not by what it holds
    with shmreplay.SequenceWriter(t, length=LENGTH, period=PERIOD) as w:
        while t.inserts < sequences:
            for _ in range(PERIOD * 8):
                w.append(obs=frames(s), tag=s - s % PERIOD)
                s += 1
                if s % EPISODE == 0:
                    w.end_episode()
            t.flush()
    return s, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sequences", type=int, default=10_000)
    ap.add_argument("--memory-gib", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--insert-rate", type=float, default=3.0)
    ap.add_argument("--sample-rate", type=float, default=45.0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    os.makedirs(a.dir, mode=0o700, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below removes what it made
    group = Cgroup(int(a.memory_gib * 2**30))
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a)}
    fields = {"obs": ("uint8", (LENGTH, *FRAME)), "length": ("int32", ()), "tag": ("int64", ())}
    table = dict(name="r2d2", capacity=a.sequences, fields=fields, sampler="prioritized", alpha=0.9,
                 frames={"obs": LENGTH}, frames_per_item=PERIOD, storage_dir=a.dir)
    try:
        group.join()
        frames = Frames()
        with shmreplay.Server(tables=[table], storage_dirs=[a.dir], sync_interval_s=30,
                              preexec=lambda: group.join()) as server, server.connect() as c:
            t = c.table("r2d2")
            steps, secs = fill(t, frames, a.sequences)
            st = c.stats()["tables"]["r2d2"]
            disk = sum(os.stat(os.path.join(a.dir, n)).st_blocks * 512 for n in os.listdir(a.dir))
            report["fill"] = {"sequences": st["size"], "steps": steps, "seconds": round(secs, 1),
                              "sequences_per_s": round(st["size"] / secs, 1),
                              "disk_bytes": disk, "rows_bytes": a.sequences * LENGTH * int(np.prod(FRAME)),
                              "peak_memory": group.peak()}
            print("fill", json.dumps(report["fill"]), flush=True)
            report["serve"] = serve(server, t, frames, steps, a)
            report["serve"]["peak_memory"] = group.peak()
            print("serve", json.dumps(report["serve"]), flush=True)
            c.drop_table("r2d2")
    finally:
        group.remove()
        shutil.rmtree(a.dir, ignore_errors=True)
    f, s = report["fill"], report["serve"]
    print(f"\n{f['sequences']:,} sequences of {LENGTH} frames {FRAME}: {f['disk_bytes'] / 1e9:.1f} GB on disk "
          f"(rows: {f['rows_bytes'] / 1e9:.1f} GB, {f['disk_bytes'] / f['rows_bytes']:.2f}x); filled at "
          f"{f['sequences_per_s']} sequences/s")
    print(f"served {s['inserted_per_s']} sequences/s in and {s['sampled_per_s']} out "
          f"(asked {a.insert_rate:g} and {a.sample_rate:g}) for {s['seconds']} s in {a.memory_gib:g} GiB "
          f"(peak {s['peak_memory'] / 2**30 if s['peak_memory'] else float('nan'):.2f} GiB); "
          f"{s['checked']:,} sampled sequences checked, {s['bad']} wrong")
    print(f"wrote {results.write(report, 'frames-disk', a.out)}")
    return 0 if s["bad"] == 0 else 1


def serve(server, t, frames: Frames, first_step: int, a) -> dict:
    """The row's rates at once for ``a.seconds``: a writer thread (its own
    client) paced at ``a.insert_rate`` sequences/s, this thread sampling
    batches of 9 at ``a.sample_rate`` sequences/s, each sequence checked."""
    stop = threading.Event()
    inserted = [0]

    def writer():
        with server.connect() as c:
            wt = c.table("r2d2")
            s = first_step + EPISODE - first_step % EPISODE  # a fresh episode
            with shmreplay.SequenceWriter(wt, length=LENGTH, period=PERIOD) as w:
                t0 = time.monotonic()
                while not stop.is_set():
                    for _ in range(PERIOD):  # one sequence's worth of steps
                        w.append(obs=frames(s), tag=s - s % PERIOD)
                        s += 1
                        if s % EPISODE == 0:
                            w.end_episode()
                    inserted[0] += 1
                    lag = t0 + inserted[0] / a.insert_rate - time.monotonic()
                    if lag > 0:
                        stop.wait(lag)

    th = threading.Thread(target=writer)
    th.start()
    batch = 9
    period = batch / a.sample_rate
    checked = bad = 0
    t0 = time.monotonic()
    batches = t.iterate(batch, beta=0.4, prefetch=2)  # a learner's loop: the next draws' frames read ahead
    try:
        for out in batches:
            if time.monotonic() - t0 >= a.seconds:
                break
            for k in range(batch):
                start = int(out.data["tag"][k])
                if not frames.check(out.data["obs"][k], start, int(out.data["length"][k])):
                    bad += 1
                checked += 1
            lag = t0 + (checked / batch) * period - time.monotonic()
            if lag > 0:
                time.sleep(lag)
    finally:
        batches.close()
        stop.set()
        th.join()
    secs = time.monotonic() - t0
    return {"seconds": round(secs, 1), "inserted_per_s": round(inserted[0] / secs, 2),
            "sampled_per_s": round(checked / secs, 1), "checked": checked, "bad": bad}


if __name__ == "__main__":
    raise SystemExit(main())
