"""Cells of ``benchmarks/capacity.py``: rows in a file on disk, read cold
(page cache dropped) and warm, by the disk itself, by numpy, by TorchRL and
by shmreplay.  Each returns a dict of numbers; nothing is asserted.

A table larger than RAM is simulated on a large box by a v1 memory cgroup
(``MemoryCgroup``) that the reading processes join: the page cache they
fill is charged to it, so a file several times its limit cannot end up
cached (FACTS.md, "Disk and memory limits").  Each cell runs in a child
process (``in_child``; TorchRL's as ``python benchmarks/harness/disk.py
torchrl ...``, so torch is never imported into the others), so no mapping
of an earlier cell keeps pages resident.  Called from the benchmark's
process, one cell at a time.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from shmreplay.bench.peers import BETA, DAEMON_NICE, nice
from shmreplay.bench.workloads import WORKLOADS

DQN = WORKLOADS["dqn-atari"]


class MemoryCgroup:
    """A v1 memory cgroup of its own, limited to ``limit`` bytes; None from
    ``make`` where none can be made (not root, no v1 memory controller)."""

    ROOT = "/sys/fs/cgroup/memory"

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def make(cls, limit: int) -> "MemoryCgroup | None":
        path = os.path.join(cls.ROOT, f"shmr-capacity-{os.getpid()}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit))
        except OSError:
            return None
        return cls(path)

    def join(self) -> None:
        """Move the calling process into it (children it starts follow)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def remove(self) -> None:
        """Once every process in it has exited."""
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def in_child(fn, *args, cgroup: MemoryCgroup | None = None):
    """``fn(*args)`` in a forked child (in ``cgroup``), its result returned."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, cgroup, fn, args))
    p.start()
    try:
        return q.get(timeout=6 * 3600)
    finally:
        p.join(60)


def _child(q, cgroup, fn, args) -> None:
    try:
        if cgroup is not None:
            cgroup.join()
        q.put(fn(*args))
    except BaseException as exc:
        q.put({"error": repr(exc)[-300:]})


def drop_caches() -> bool:
    """Write dirty pages back, then drop the page cache (root only); False
    when it could not, so cold numbers are marked warm-ish."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm(path: str, chunk: int = 8 << 20) -> None:
    """Read a whole file once, so its pages are in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(chunk)
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)


def make_rows_file(path: str, rows: int, row_bytes: int, chunk_rows: int = 1024) -> None:
    """``rows`` random rows, written sequentially and synced."""
    block = np.random.default_rng(0).integers(0, 256, chunk_rows * row_bytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for lo in range(0, rows, chunk_rows):
            f.write(block[:min(chunk_rows, rows - lo) * row_bytes])
        os.fsync(f.fileno())


def _distinct(rows: int, count: int, seed: int) -> np.ndarray:
    """``count`` different random rows: none is read twice, so none is cached by a read before."""
    return np.random.default_rng(seed).permutation(rows)[:min(count, rows)]


def ceiling(path: str, rows: int, row_bytes: int, threads: int, count: int) -> dict:
    """The disk's random-read rate for this row size: ``threads`` threads,
    each one ``preadv`` of one row at a time (queue depth = threads)."""
    idx = _distinct(rows, count, seed=threads)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: only the row is read

    def work(part):
        buf = bytearray(row_bytes)
        for r in part.tolist():
            os.preadv(fd, [buf], r * row_bytes)
    parts = np.array_split(idx, threads)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(p,)) for p in parts]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    os.close(fd)
    return _rate(idx.shape[0], row_bytes, dt)


def fadvise_batches(path: str, rows: int, row_bytes: int, count: int, batch: int) -> dict:
    """What POSIX_FADV_WILLNEED gives from one thread: advise a batch of
    rows, then read them (each read waits for its row), batch after batch."""
    idx = _distinct(rows, count, seed=99)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    buf = bytearray(row_bytes)
    t0 = time.perf_counter()
    for lo in range(0, idx.shape[0], batch):
        part = idx[lo:lo + batch].tolist()
        for r in part:
            os.posix_fadvise(fd, r * row_bytes, row_bytes, os.POSIX_FADV_WILLNEED)
        for r in part:
            os.preadv(fd, [buf], r * row_bytes)
    dt = time.perf_counter() - t0
    os.close(fd)
    return _rate(idx.shape[0], row_bytes, dt)


def memmap_gather(path: str, rows: int, row_bytes: int, batches: int, batch: int,
                  seconds: float, random_advice: bool = False) -> dict:
    """A plain ``np.memmap`` gather of random batches (``np.take``): every
    row not in the cache is a page fault, one at a time.  ``random_advice``:
    the mapping gets MADV_RANDOM first, as shmreplay's clients do."""
    with open(path, "rb") as f:  # what np.memmap does, with the mapping in hand for madvise
        raw = mmap.mmap(f.fileno(), rows * row_bytes, prot=mmap.PROT_READ)
    if random_advice:
        raw.madvise(mmap.MADV_RANDOM)
    mm = np.frombuffer(raw, np.uint8).reshape(rows, row_bytes)
    out = np.empty((batch, row_bytes), np.uint8)
    idx = _distinct(rows, batches * batch, seed=7)
    t0, n = time.perf_counter(), 0
    for lo in range(0, idx.shape[0], batch):  # stops early when slow: rows/s is what counts
        np.take(mm, idx[lo:lo + batch], axis=0, out=out, mode="clip")
        n += min(batch, idx.shape[0] - lo)
        if time.perf_counter() - t0 > seconds:
            break
    dt = time.perf_counter() - t0
    del mm
    raw.close()
    return _rate(n, row_bytes, dt)


def _rate(n: int, row_bytes: int, dt: float) -> dict:
    return {"rows": int(n), "seconds": round(dt, 3), "rows_per_s": n / dt, "GB_per_s": n * row_bytes / dt / 1e9}


# ---------------------------------------------------------------- TorchRL

def _torchrl_buffer(directory: str, rows: int, batch: int):
    import torch
    from torchrl.data import LazyMemmapStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import RandomSampler
    torch.set_num_threads(1)
    storage = LazyMemmapStorage(rows, scratch_dir=os.path.join(directory, "storage"), existsok=True)
    return ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=batch)


def torchrl_fill(directory: str, rows: int, batch: int) -> dict:
    """Child process: a LazyMemmapStorage of dqn-atari rows in ``directory``,
    saved where it lies (``dumps`` into its own scratch directory copies nothing)."""
    import torch
    from tensordict import TensorDict
    rb = _torchrl_buffer(directory, rows, batch)  # loads() takes the batch size from here
    chunk = DQN.rows(1024, seed=3)
    td = TensorDict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in chunk.items()}, batch_size=[1024])
    t0 = time.perf_counter()
    for lo in range(0, rows, 1024):
        rb.extend(td[:min(1024, rows - lo)])
    rb.dumps(directory)
    return {"fill_s": round(time.perf_counter() - t0, 1)}


def torchrl_sample(directory: str, rows: int, batches: int, batch: int, seconds: float,
                   cold: bool, cgroup: str = "") -> dict:
    """Another child (so no mapping of the fill keeps pages resident): the
    storage loaded from disk (mapped, not copied), sampled by a
    RandomSampler.  Its prioritized sampler's C++ tree does not load against
    this machine's torch; the storage is what is measured."""
    if cgroup:
        MemoryCgroup(cgroup).join()
    rb = _torchrl_buffer(directory, rows, batch)
    rb.loads(directory)
    dropped = drop_caches() if cold else False
    rb.sample(batch)  # the first sample builds the sampler's state
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        assert rb.sample(batch)["obs"].shape[0] == batch  # a copy: every row was read
        n += batch
        if time.perf_counter() - t0 > seconds:
            break
    return {**_rate(n, DQN.item_bytes, time.perf_counter() - t0), "cold": dropped}


def run_torchrl(rows: int, batches: int, batch: int, seconds: float, cold: bool, where: str,
                cgroup: MemoryCgroup | None = None) -> dict:
    """The TorchRL cell in two child processes; {"error": ...} when it cannot run here."""
    d = tempfile.mkdtemp(prefix="torchrl-", dir=where)
    base = [sys.executable, os.path.abspath(__file__)]  # run as a script: its imports are absolute
    try:
        res = {}
        for cmd in (["fill", d, str(rows), str(batch)],
                    ["sample", d, str(rows), str(batches), str(batch), str(seconds), "1" if cold else "0",
                     cgroup.path if cgroup else ""]):
            out = subprocess.run(base + cmd, capture_output=True, text=True, timeout=3600)
            if out.returncode != 0:
                return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1][-300:]}
            res.update(json.loads(out.stdout.strip().splitlines()[-1]))
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- shmreplay

class BenchDaemon:
    """A private shmreplayd (``shmreplay.Server``) with file-backed tables in
    ``store`` kept across restarts (``retain_tables``, one instance name), so
    one table is served under several prefetch settings; at DAEMON_NICE and
    in ``cgroup`` from its first page on.  ``restart`` and ``stop`` from the
    benchmark's thread; ``socket`` is the running daemon's."""

    def __init__(self, store: str):
        self.store = store
        self.instance = f"capbench{os.getpid()}"
        self.server = None
        self.retain = True

    @property
    def socket(self) -> str:
        return self.server.socket

    def start(self, threads: int = 16, method: str = "pread", retain: bool = True,
              cgroup: MemoryCgroup | None = None) -> None:
        import shmreplay

        def setup():
            nice(DAEMON_NICE)
            if cgroup is not None:
                cgroup.join()
        self.retain = retain
        self.server = shmreplay.Server(instance=self.instance, timeout=300, preexec=setup,
                                       storage_dirs=[self.store], retain_tables=retain,
                                       prefetch_threads=threads, prefetch_method=method, log_level="warning")

    def connect(self):
        import shmreplay
        return shmreplay.connect(self.socket, timeout=120)

    def stop(self) -> None:
        """Stop the daemon; it must exit 0, and, unless it retains its
        tables (which stay in /dev/shm for the next start by design), leave
        nothing of its instance in /dev/shm (``Server.stop`` checks)."""
        if self.server is not None:
            code = self.server.stop(check=not self.retain)
            if code != 0:
                raise RuntimeError(f"shmreplayd exited with code {code}")
        self.server = None

    def restart(self, threads: int, method: str = "pread", cgroup: MemoryCgroup | None = None) -> None:
        self.stop()
        self.start(threads, method, cgroup=cgroup)


def fill(sock: str, name: str, rows: int, chunk: int = 256) -> float:
    """Insert ``rows`` dqn-atari items; returns the seconds it took (flushed)."""
    import shmreplay
    data = DQN.rows(chunk, seed=5)
    with shmreplay.connect(sock, timeout=120) as c:
        table = c.table(name)
        t0 = time.perf_counter()
        for lo in range(0, rows, chunk):
            k = min(chunk, rows - lo)
            table.insert_batch({f: v[:k] for f, v in data.items()})
        table.flush()
        return time.perf_counter() - t0


def learn(sock: str, name: str, batch: int, batches: int, seconds: float, prefetch: int) -> dict:
    """``learner`` on its own connection, with the table's prefetch counters
    of the run."""
    import shmreplay
    with shmreplay.connect(sock, timeout=120) as c:
        before = prefetch_stats(c, name)
        r = learner(c.table(name), batch, batches, seconds, prefetch)
        r.update({k: v - before.get(k, 0) for k, v in prefetch_stats(c, name).items()})
        return r


def learner(table, batch: int, batches: int, seconds: float, prefetch: int,
            rate: float | None = None) -> dict:
    """Prioritized draws with their data and a priority update each, through
    ``iterate(prefetch=k)`` (k 0: plain ``sample``), until ``batches`` or
    ``seconds``, at most ``rate`` items/s (None: as fast as it goes);
    items/s and GB/s gathered."""
    rng = np.random.default_rng(2)
    n, t0 = 0, time.perf_counter()
    it = table.iterate(batch, beta=BETA, prefetch=prefetch) if prefetch else None
    out = None
    try:
        for _ in range(batches):
            b = next(it) if it is not None else table.sample(batch, beta=BETA, out=out)
            out = b if it is None else None
            table.update_priorities(b.keys, rng.uniform(0.1, 2.0, batch))
            n += batch
            now = time.perf_counter()
            if now - t0 > seconds:
                break
            if rate is not None and n / rate > now - t0:  # a learner step's pace
                time.sleep(n / rate - (now - t0))
    finally:
        if it is not None:
            it.close()
    row = sum(np.dtype(f.dtype).itemsize * int(np.prod(f.shape)) for f in table.spec.fields)
    return _rate(n, row, time.perf_counter() - t0)


def prefetch_stats(client, name: str) -> dict:
    t = client.stats()["tables"][name]
    return {k: t[k] for k in ("prefetch_reads", "prefetch_bytes", "prefetch_dropped") if k in t}


def main(argv=None) -> int:
    """The TorchRL cells' child processes: ``fill DIR ROWS BATCH`` and ``sample DIR
    ROWS BATCHES BATCH SECONDS COLD [CGROUP]``; one JSON line out."""
    ap = argparse.ArgumentParser()
    ap.add_argument("cell", choices=["fill", "sample"])
    ap.add_argument("args", nargs="*")
    a = ap.parse_args(argv)
    if a.cell == "fill":
        d, rows, batch = a.args
        res = torchrl_fill(d, int(rows), int(batch))
    else:
        d, rows, batches, batch, seconds, cold, cgroup = (a.args + [""])[:7]
        res = torchrl_sample(d, int(rows), int(batches), int(batch), float(seconds), cold == "1", cgroup)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
