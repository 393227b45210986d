"""Replay libraries behind one narrow interface, so every cell runs the same
loop for each.  A peer is used from one process; ``mp_run`` starts its own
actor processes.

    open(workload)              build the buffer (alpha 0.6, prioritized)
    insert(rows, n)             insert n items (n == 1: the single-item call)
    sample_update(beta)         one prioritized batch with data and weights,
                                then a priority update of its keys
    mp_run(actors, chunk, s)    actors insert chunks for s seconds while this
                                process samples and updates; returns rates
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from .workloads import WORKLOADS, Workload

BETA = 0.4
# Process priorities as deployed: the daemon at the systemd unit's Nice=-5,
# every library's actors at +5 so the learner (0) is not starved on 2 cores.
DAEMON_NICE = -5
ACTOR_NICE = 5


def nice(increment: int) -> None:
    try:
        os.nice(increment)
    except OSError:  # lowering nice needs privileges; run as is
        pass


def available() -> list[str]:
    """shmreplay and every peer library that works here.  TorchRL counts
    only if its prioritized buffer can be built: its sum tree is a C++
    extension, and a wheel built against another torch imports fine but
    fails there (seen: torchrl 0.13/0.14 against torch 2.13.0+cpu)."""
    import importlib.util
    names = ["shmreplay"]
    if importlib.util.find_spec("cpprb") is not None:
        names.append("cpprb")
    if importlib.util.find_spec("torchrl") is not None:
        probe = subprocess.run(
            [sys.executable, "-c", "from torchrl.data import PrioritizedSampler; PrioritizedSampler(8, 0.6, 0.4)"],
            capture_output=True, timeout=120)
        if probe.returncode == 0:
            names.append("torchrl")
    return names


def make(name: str):
    return {"shmreplay": ShmreplayPeer, "cpprb": CpprbPeer, "torchrl": TorchrlPeer}[name]()


def _new_priorities(n: int, rng) -> np.ndarray:
    return rng.uniform(0.1, 2.0, size=n)


# ---------------------------------------------------------------- shmreplay

class Daemon:
    """A private shmreplayd for one cell (started and stopped by the cell)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="shmreplay-bench-")
        self.socket = os.path.join(self.dir, "d.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmreplay.server.daemon", "--socket", self.socket,
             "--instance", f"bench{os.getpid()}", "--log-level", "warning"],
            preexec_fn=lambda: nice(DAEMON_NICE))
        import shmreplay
        for _ in range(1200):
            try:
                shmreplay.connect(self.socket, timeout=10).close()
                return
            except shmreplay.DaemonUnavailable:
                if self.proc.poll() is not None:
                    raise RuntimeError("shmreplayd failed to start")
                time.sleep(0.05)
        raise RuntimeError("shmreplayd did not come up")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


class ShmreplayPeer:
    name = "shmreplay"

    def open(self, w: Workload) -> None:
        import shmreplay
        self.w = w
        self.daemon = Daemon()
        self.client = shmreplay.connect(self.daemon.socket, timeout=120)
        self.table = self.client.create_table("bench", capacity=w.capacity, fields=w.fields,
                                              sampler="prioritized", alpha=0.6)
        self.batch = None
        self.rng = np.random.default_rng(1)

    def insert(self, rows: dict, n: int) -> None:
        if n == 1:
            self.table.insert(**{k: v[0] for k, v in rows.items()})
        else:
            self.table.insert_batch(rows)

    def settle(self) -> None:
        self.table.flush()

    def size(self) -> int:
        return len(self.table)

    def sample_update(self, beta: float = BETA) -> dict:
        b = self.batch = self.table.sample(self.w.batch, beta=beta, out=self.batch)
        self.table.update_priorities(b.keys, _new_priorities(self.w.batch, self.rng))
        return b.data

    def sample_update_iter(self, beta: float = BETA) -> dict:
        """The recommended learner loop: t.iterate() prefetches 2 batches."""
        if getattr(self, "it", None) is None:
            self.it = self.table.iterate(self.w.batch, beta=beta, prefetch=2)
        b = next(self.it)
        self.table.update_priorities(b.keys, _new_priorities(self.w.batch, self.rng))
        return b.data

    def close(self) -> None:
        if getattr(self, "it", None) is not None:
            self.it.close()
        self.client.close()
        self.daemon.stop()

    def mp_run(self, actors: int, chunk: int, seconds: float) -> dict:
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_shm_actor, args=(self.daemon.socket, self.w.key, chunk, seconds, a,
                                                      start, out)) for a in range(actors)]
        return _run_mp(procs, start, out, seconds, self.sample_update_iter, self.size)


def _shm_actor(sock, wkey, chunk, seconds, seed, start, out):
    import shmreplay
    nice(ACTOR_NICE)
    w = WORKLOADS[wkey]
    rows = w.rows(chunk, seed)
    with shmreplay.connect(sock, timeout=120) as c:
        t = c.table("bench")
        start.wait()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t.insert_batch(rows)
            n += chunk
        t.flush()
    out.put(n)


# -------------------------------------------------------------------- cpprb

def _env_dict(w: Workload) -> dict:
    return {k: {"shape": s if s else 1, "dtype": np.dtype(d)} for k, (d, s) in w.fields.items()}


class CpprbPeer:
    name = "cpprb"

    def open(self, w: Workload, mp_ctx=None) -> None:
        import cpprb
        self.w = w
        self.rng = np.random.default_rng(1)
        if mp_ctx is None:
            self.rb = cpprb.PrioritizedReplayBuffer(w.capacity, _env_dict(w), alpha=0.6)
        else:
            self.rb = cpprb.MPPrioritizedReplayBuffer(w.capacity, _env_dict(w), alpha=0.6,
                                                      ctx=mp_ctx, backend="SharedMemory")

    def insert(self, rows: dict, n: int) -> None:
        if n == 1:
            self.rb.add(**{k: v[0] for k, v in rows.items()})
        else:
            self.rb.add(**rows)

    def settle(self) -> None:
        pass

    def size(self) -> int:
        return int(self.rb.get_stored_size())

    def sample_update(self, beta: float = BETA) -> dict:
        s = self.rb.sample(self.w.batch, beta=beta)
        self.rb.update_priorities(s["indexes"], _new_priorities(self.w.batch, self.rng))
        return s

    def close(self) -> None:
        self.rb = None

    def mp_run(self, actors: int, chunk: int, seconds: float) -> dict:
        ctx = mp.get_context("fork")
        self.open(self.w, mp_ctx=ctx)  # the multiprocess buffer replaces the local one
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_cpprb_actor, args=(self.rb, self.w.key, chunk, seconds, a, start, out))
                 for a in range(actors)]
        return _run_mp(procs, start, out, seconds, self.sample_update, self.size)


def _cpprb_actor(rb, wkey, chunk, seconds, seed, start, out):
    _actor_loop(lambda rows: rb.add(**rows), wkey, chunk, seconds, seed, start, out)


def _actor_loop(put, wkey, chunk, seconds, seed, start, out):
    """A peer's actor process: put(rows) chunks for `seconds` (or until put
    returns False), report how many items went in."""
    nice(ACTOR_NICE)
    rows = WORKLOADS[wkey].rows(chunk, seed)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if put(rows) is False:
            break
        n += chunk
    out.put(n)


# ------------------------------------------------------------------ torchrl

class TorchrlPeer:
    """TorchRL's TensorDictPrioritizedReplayBuffer over a LazyTensorStorage
    (its in-memory storage), batches as TensorDicts built once from the same
    numpy rows (torch.from_numpy shares them, so no copy is added).

    TorchRL's prioritized sampler lives in the process that built the
    buffer, so the multiprocess cell uses the pattern its users use: actors
    send their chunks over a multiprocessing queue and the learner extends
    the buffer with whatever arrived before each sample."""

    name = "torchrl"

    def open(self, w: Workload) -> None:
        import torch
        from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
        torch.set_num_threads(1)  # one learner thread, like the other peers
        self.torch = torch
        self.w = w
        self.rng = np.random.default_rng(1)
        self.rb = TensorDictPrioritizedReplayBuffer(
            alpha=0.6, beta=BETA, storage=LazyTensorStorage(w.capacity), batch_size=w.batch)
        self._tds = {}

    def _td(self, rows: dict, n: int):
        key = (id(rows), n)
        if key not in self._tds:
            self._tds[key] = _to_td(rows, n)
        return self._tds[key]

    def insert(self, rows: dict, n: int) -> None:
        td = self._td(rows, n)
        if n == 1:
            self.rb.add(td[0])
        else:
            self.rb.extend(td)

    def settle(self) -> None:
        pass

    def size(self) -> int:
        return len(self.rb)

    def sample_update(self, beta: float = BETA) -> dict:
        s = self.rb.sample()
        self.rb.update_priority(s["index"], self.torch.from_numpy(_new_priorities(self.w.batch, self.rng)))
        return s

    def close(self) -> None:
        self.rb = None

    def mp_run(self, actors: int, chunk: int, seconds: float) -> dict:
        import queue
        ctx = mp.get_context("spawn")
        # a short queue: what is still in it at the end was counted by the
        # actors but never inserted (at most 8 chunks)
        start, out, q = ctx.Event(), ctx.Queue(), ctx.Queue(maxsize=8)
        procs = [ctx.Process(target=_queue_actor, args=(q, self.w.key, chunk, seconds, a, start, out))
                 for a in range(actors)]

        def drain() -> None:
            while True:
                try:
                    rows = q.get_nowait()
                except queue.Empty:
                    return
                self.rb.extend(_to_td(rows, chunk))

        def sampleable() -> int:  # the learner starts once a batch is stored
            drain()
            return len(self.rb) if len(self.rb) >= self.w.batch else 0

        def drain_sample_update():
            drain()
            return self.sample_update()
        return _run_mp(procs, start, out, seconds, drain_sample_update, sampleable)


def _to_td(rows: dict, n: int):
    import torch
    from tensordict import TensorDict
    return TensorDict({k: torch.from_numpy(np.ascontiguousarray(v[:n])) for k, v in rows.items()},
                      batch_size=[n])


def _queue_actor(q, wkey, chunk, seconds, seed, start, out):
    import queue

    def put(rows) -> bool:
        # the learner stops draining when its time is up; an actor blocked on
        # a full queue then gives up instead of hanging the cell
        try:
            q.put(rows, timeout=seconds + 5)
            return True
        except queue.Full:
            return False
    _actor_loop(put, wkey, chunk, seconds, seed, start, out)


# ------------------------------------------------------------------ shared

def _run_mp(procs, start, out, seconds, sample_update, size) -> dict:
    for p in procs:
        p.start()
    time.sleep(1.0)  # let every actor attach before the clock starts
    start.set()
    t0 = time.perf_counter()
    while size() == 0 and time.perf_counter() - t0 < seconds:
        time.sleep(0.001)
    batches = 0
    while time.perf_counter() - t0 < seconds:
        sample_update()
        batches += 1
    learn_s = time.perf_counter() - t0
    inserted = sum(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    return {"inserts_per_s": inserted / seconds, "batches_per_s": batches / learn_s}
