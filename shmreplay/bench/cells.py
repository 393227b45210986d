"""One benchmark cell per process: ``python -m shmreplay.bench.cells CELL PEER WORKLOAD``.

Prints one JSON line.  Cells:

    insert1, insert64   single client, items/s (and MB/s)
    sample              prioritized sample (alpha 0.6, beta 0.4) with data and
                        weights, then update_priorities; batches/s (and GB/s)
    sample_it           shmreplay only: the same loop through t.iterate(prefetch=2)
    mp2, mp4, mpN       2, 4 or N actor processes inserting chunks of 16 while one
                        learner samples and updates; inserts/s and batches/s
    qmp2, qmp4, qmpN    the same into a queue (shmreplay: create_queue, each item
                        sampled once, in order; a peer without queues: its mp cell)
    gather              numpy ceiling: np.take(ring, idx, out=, mode="clip"); also
                        the same gather split over two threads
    write               ceiling for inserts: chunks of 64 rows copied from a
                        cache-hot source into successive rows of a ring of the
                        table's size (what a perfect in-process buffer does)
    copy                numpy ceiling: np.copyto of 1 GiB
    rtt                 shmreplay only: SAMPLE round trip (command sent -> keys,
                        probabilities and weights in the client), 1M items
    daemon_cpu          shmreplay only: daemon CPU while one actor inserts
                        1,000 items/s, and while idle
    infer, infer_sleep  shmreplay only, no daemon: the inference channel's
                        round trip (one env process, one learner, the
                        protocol doc's fields): median and p99 per call; with
                        the default spin, and with spin_us=0 (both sides
                        sleep every time); the workload is not used
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

import numpy as np

from . import peers
from .workloads import WORKLOADS, Workload


def _timed(fn, seconds: float, per_call: int = 1) -> float:
    fn()  # warm-up: the first call of a writer reserves its slots,
    fn()  # the second is the steady path (shmreplay's compiles its insert kernel on a new machine)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += per_call
    return n / (time.perf_counter() - t0)


def _fill(peer, w: Workload) -> None:
    chunk = max(1, min(4096, (64 << 20) // w.item_bytes))
    rows = w.rows(chunk, seed=5)
    left = w.capacity
    while left > 0:
        k = min(chunk, left)
        peer.insert(rows if k == chunk else {f: v[:k] for f, v in rows.items()}, k)
        left -= k
    peer.settle()


def cell_insert(peer, w: Workload, chunk: int, seconds: float) -> dict:
    peer.open(w)
    try:
        rows = w.rows(chunk)
        rate = _timed(lambda: peer.insert(rows, chunk), seconds, chunk)
        peer.settle()
    finally:
        peer.close()
    return {"items_per_s": rate, "MB_per_s": rate * w.item_bytes / 1e6}


def cell_sample(peer, w: Workload, seconds: float, prefetch: bool = False) -> dict:
    peer.open(w)
    try:
        _fill(peer, w)
        rate = _timed(peer.sample_update_iter if prefetch else peer.sample_update, seconds)
    finally:
        peer.close()
    return {"batches_per_s": rate, "GB_per_s": rate * w.batch * w.item_bytes / 1e9}


def cell_mp(peer, w: Workload, actors: int, seconds: float) -> dict:
    peer.open(w)
    try:
        return peer.mp_run(actors, 16, seconds)
    finally:
        peer.close()


def cell_gather(w: Workload, seconds: float) -> dict:
    """WORKLOADS.md's ceiling: one np.take of a batch of whole rows.  The
    two-thread figure is what this machine's memory gives a gather at all;
    the target check uses it to tell a slow cell from an impossible one."""
    from concurrent.futures import ThreadPoolExecutor
    ring = np.ones((w.capacity, w.item_bytes), dtype=np.uint8)
    out = np.empty((w.batch, w.item_bytes), dtype=np.uint8)
    rng = np.random.default_rng(0)
    rate = _timed(lambda: np.take(ring, rng.integers(0, w.capacity, size=w.batch), axis=0,
                                  out=out, mode="clip"), seconds)
    half = w.batch // 2
    with ThreadPoolExecutor(1) as pool:
        def two():
            idx = rng.integers(0, w.capacity, size=w.batch)
            f = pool.submit(np.take, ring, idx[half:], 0, out[half:], "clip")
            np.take(ring, idx[:half], axis=0, out=out[:half], mode="clip")
            f.result()
        rate2 = _timed(two, seconds)
    per_batch = w.batch * w.item_bytes / 1e9
    return {"batches_per_s": rate, "GB_per_s": rate * per_batch, "GB_per_s_2threads": rate2 * per_batch}


def cell_write(w: Workload, seconds: float, chunk: int = 64) -> dict:
    ring = np.ones((w.capacity, w.item_bytes), dtype=np.uint8)
    src = np.full((chunk, w.item_bytes), 3, dtype=np.uint8)
    n, pos = w.capacity // chunk, [0]

    def put():
        i = pos[0]
        ring[i * chunk:(i + 1) * chunk] = src
        pos[0] = (i + 1) % n
    rate = _timed(put, seconds, chunk)
    return {"items_per_s": rate, "GB_per_s": rate * w.item_bytes / 1e9}


def cell_copy(seconds: float) -> dict:
    src = np.ones(1 << 30, dtype=np.uint8)
    dst = np.ones(1 << 30, dtype=np.uint8)
    rate = _timed(lambda: np.copyto(dst, src), seconds)
    return {"GB_per_s": rate * (1 << 30) / 1e9}


def cell_rtt(w: Workload, calls: int = 3000) -> dict:
    peer = peers.ShmreplayPeer()
    peer.open(w)
    try:
        _fill(peer, w)
        t = peer.table
        lat = np.empty(calls)
        for i in range(calls):
            t0 = time.perf_counter()
            t.sample_indices(w.batch, beta=peers.BETA)
            lat[i] = time.perf_counter() - t0
    finally:
        peer.close()
    return {"median_us": float(np.median(lat) * 1e6), "p99_us": float(np.percentile(lat, 99) * 1e6),
            "items": w.capacity}


def cell_daemon_cpu(w: Workload, seconds: float) -> dict:
    peer = peers.ShmreplayPeer()
    peer.open(w)
    try:
        rows = w.rows(1)
        t = peer.table
        c0, t0 = peer.daemon.cpu_seconds(), time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:  # paced at 1,000 items/s
            peer.insert(rows, 1)
            n += 1
            ahead = n / 1000.0 - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
        t.flush()
        busy = (peer.daemon.cpu_seconds() - c0) / (time.perf_counter() - t0)
        rate = n / (time.perf_counter() - t0)
        c0, t0 = peer.daemon.cpu_seconds(), time.perf_counter()
        time.sleep(seconds)
        idle = (peer.daemon.cpu_seconds() - c0) / (time.perf_counter() - t0)
    finally:
        peer.close()
    return {"core_fraction_at_1k_inserts": busy, "inserts_per_s": rate, "core_fraction_idle": idle}


_INFER_REQUEST = {"obs": ("float32", (4,)), "reward": ("float32", ()), "done": ("bool", ())}
_INFER_RESPONSE = {"action": ("int64", ())}


def _infer_env(address: str, spin_us: float, seconds: float, conn) -> None:
    import shmreplay
    with shmreplay.InferenceClient(address, timeout=30.0, spin_us=spin_us) as ch:
        obs = np.zeros(4, np.float32)
        for _ in range(500):  # warm-up
            ch.call(obs=obs, reward=0.0, done=False)
        lat, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            ch.call(obs=obs, reward=1.0, done=False)
            lat.append(time.perf_counter() - t0)
    conn.send(lat)


def cell_infer(seconds: float, spin_us: float | None) -> dict:
    import multiprocessing as mp

    import shmreplay
    kw = {} if spin_us is None else {"spin_us": spin_us}
    with shmreplay.InferenceServer(_INFER_REQUEST, _INFER_RESPONSE, slots=1, **kw) as srv:
        ctx = mp.get_context("fork")
        mine, theirs = ctx.Pipe()
        env = ctx.Process(target=_infer_env, args=(srv.address, 50 if spin_us is None else spin_us,
                                                    seconds, theirs))
        env.start()
        try:
            while not mine.poll(0):
                try:
                    b = srv.receive(timeout=0.2)
                except shmreplay.ReplayTimeout:
                    if not env.is_alive() and not mine.poll(0):
                        raise SystemExit(f"the env process ended: exit {env.exitcode}") from None
                    continue
                srv.respond(b.slots, action=(b.data["obs"][:, 0] < 10).astype(np.int64))
            lat = np.array(mine.recv())
        finally:
            env.join(30)
    return {"median_us": float(np.median(lat) * 1e6), "p99_us": float(np.percentile(lat, 99) * 1e6),
            "calls": len(lat)}


def run(cell: str, peer_name: str, wkey: str, seconds: float, capacity: int | None = None) -> dict:
    if cell == "copy":
        return cell_copy(seconds)
    if cell in ("infer", "infer_sleep"):
        return cell_infer(seconds, None if cell == "infer" else 0.0)
    w = WORKLOADS[wkey]
    if capacity:  # smoke tests, or a peer that cannot hold the workload's capacity
        w = dataclasses.replace(w, capacity=capacity)
    if cell in ("insert1", "insert64"):
        return cell_insert(peers.make(peer_name), w, int(cell[6:]), seconds)
    if cell == "sample":
        return cell_sample(peers.make(peer_name), w, seconds)
    if cell == "sample_it":
        return cell_sample(peers.make(peer_name), w, seconds, prefetch=True)
    mp = re.fullmatch(r"(q?)mp([1-9][0-9]*)", cell)
    if mp:
        peer = peers.make(peer_name)
        if mp.group(1) and peer_name == "shmreplay":
            peer.queue = True
        return cell_mp(peer, w, int(mp.group(2)), seconds)
    if cell == "gather":
        return cell_gather(w, seconds)
    if cell == "write":
        return cell_write(w, seconds)
    if cell == "rtt":
        return cell_rtt(w)
    if cell == "daemon_cpu":
        return cell_daemon_cpu(w, seconds)
    raise SystemExit(f"unknown cell {cell!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cell")
    ap.add_argument("peer")
    ap.add_argument("workload")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--capacity", type=int, help="items, instead of the workload's (reported)")
    a = ap.parse_args(argv)
    result = run(a.cell, a.peer, a.workload, a.seconds, a.capacity)
    if a.capacity:
        result["capacity"] = a.capacity
    print(json.dumps({"cell": a.cell, "peer": a.peer, "workload": a.workload, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
