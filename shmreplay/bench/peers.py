"""Replay libraries behind one narrow interface, so every cell runs the same
loop for each.  A peer is used from one process; ``mp_run`` starts its own
actor processes.

    open(workload)              build the buffer (alpha 0.6, prioritized)
    insert(rows, n)             insert n items (n == 1: the single-item call)
    sample_update(beta)         one prioritized batch with data and weights,
                                then a priority update of its keys
    mp_run(actors, chunk, s)    this process samples and updates for s seconds
                                while actors insert chunks; returns rates

shmreplay and cpprb are here; TorchRL, Reverb and Flashbax are in their own
modules and run under their own venv's python (peerenv.py).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import multiprocessing as mp
import os
import queue
import time

import numpy as np

from . import peerenv
from .workloads import WORKLOADS, Workload

BETA = 0.4
# Process priorities as deployed: the daemon at the systemd unit's Nice=-5.
# The multi-process cells' actors run at the nice the library gives them,
# none set by hand (issue 36, item 3): shmreplay's through its actor loop's
# ``yield_to_learners`` (+5; by hand, the same, on a revision without it),
# the peers' at 0, as their users run them.  ACTOR_NICE is the by-hand
# level the other harnesses (benchmarks/harness/) still set.
DAEMON_NICE = -5
ACTOR_NICE = 5
# the classes of the peers that live in their own module (and venv)
ELSEWHERE = {"torchrl": "torchrlpeer.TorchrlPeer", "reverb": "reverbpeer.ReverbPeer",
             "flashbax": "flashbaxpeer.FlashbaxPeer"}


def nice(increment: int) -> None:
    try:
        os.nice(increment)
    except OSError:  # lowering nice needs privileges; run as is
        pass


@contextlib.contextmanager
def niced(increment: int):
    """This thread ``increment`` nicer for the block, then as it was: a
    process forked in the block starts at that nice (Linux keeps nice per
    thread, and a child inherits its forking thread's)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's
    nice(increment)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


def available() -> dict:
    """Every library of the suite -> None when it works here, else why not
    (a missing venv, an import error, a prioritized buffer that cannot be
    built: TorchRL's sum tree is a C++ extension, and a wheel built against
    another torch imports fine but fails there).  Never raises."""
    out = {}
    for name in peerenv.SPECS:
        out[name] = peerenv.probe(name).get("missing")
    return out


def make(name: str):
    if name in ELSEWHERE:
        module, cls = ELSEWHERE[name].split(".")
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)()
    return {"shmreplay": ShmreplayPeer, "cpprb": CpprbPeer}[name]()


def new_priorities(n: int, rng) -> np.ndarray:
    return rng.uniform(0.1, 2.0, size=n)


# ---------------------------------------------------------------- shmreplay


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Daemon:
    """A private shmreplayd for one cell (``shmreplay.Server``, started and
    stopped by the cell), at DAEMON_NICE from its first thread on."""

    def __init__(self):
        import shmreplay
        kw = {"instance": f"bench{os.getpid()}", "log_level": "warning"}
        if "preexec" in inspect.signature(shmreplay.Server).parameters:
            self.server = shmreplay.Server(**kw, preexec=lambda: nice(DAEMON_NICE))
        else:  # a Server before 29bb116 (compare.py --before runs this harness on it)
            with niced(DAEMON_NICE):  # the same nice, inherited from this thread at the fork
                self.server = shmreplay.Server(**kw)
        self.socket = self.server.socket

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.server.pid)

    def stop(self) -> None:
        self.server.stop()


class ShmreplayPeer:
    name = "shmreplay"
    queue = False  # the qmp cells: a queue (each item sampled once, in order)

    def open(self, w: Workload) -> None:
        import shmreplay
        self.w = w
        self.daemon = Daemon()
        self.client = shmreplay.connect(self.daemon.socket, timeout=120)
        if self.queue:
            self.table = self.client.create_queue("bench", w.capacity, w.fields)
        else:
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
        self.table.update_priorities(b.keys, new_priorities(self.w.batch, self.rng))
        return b.data

    def sample_update_iter(self, beta: float = BETA) -> dict:
        """The recommended learner loop: t.iterate() prefetches 2 batches."""
        if getattr(self, "it", None) is None:
            self.it = self.table.iterate(self.w.batch, beta=beta, prefetch=2)
        b = next(self.it)
        if not self.queue:
            self.table.update_priorities(b.keys, new_priorities(self.w.batch, self.rng))
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
        return run_mp(procs, start, out, seconds, self.sample_update_iter, self.size)


def _shm_actor(sock, wkey, chunk, seconds, seed, start, out):
    import shmreplay
    if hasattr(shmreplay, "yield_to_learners"):
        shmreplay.yield_to_learners()  # what an actor loop (shmreplay.actor_steps) does
    else:  # a revision before it (compare.py --before): the same level, by hand
        nice(ACTOR_NICE)
    w = WORKLOADS[wkey]
    rows = w.rows(chunk, seed)
    with shmreplay.connect(sock, timeout=120) as c:
        t = c.table("bench")
        out.put(None)  # attached
        start.wait()
        n, t0 = 0, time.perf_counter()
        while running(start, t0, seconds):
            try:  # a full queue holds an insert until the learner takes items,
                t.insert_batch(rows, timeout=0.5)  # and it stops at the end
            except shmreplay.RateLimited:
                continue
            n += chunk
        t.flush()
    out.put((n, time.perf_counter() - t0))


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
        self.rb.update_priorities(s["indexes"], new_priorities(self.w.batch, self.rng))
        return s

    def close(self) -> None:
        self.rb = None

    def mp_run(self, actors: int, chunk: int, seconds: float) -> dict:
        ctx = mp.get_context("fork")
        self.open(self.w, mp_ctx=ctx)  # the multiprocess buffer replaces the local one
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_cpprb_actor, args=(self.rb, self.w.key, chunk, seconds, a, start, out))
                 for a in range(actors)]
        return run_mp(procs, start, out, seconds, self.sample_update, self.size)


def _cpprb_actor(rb, wkey, chunk, seconds, seed, start, out):
    actor_loop(lambda rows: rb.add(**rows), wkey, chunk, seconds, seed, start, out)


def actor_loop(put, wkey, chunk, seconds, seed, start, out):
    """A peer's actor process: put(rows) chunks while the learner runs (or
    until put returns False), report how many items went in and in how long.
    At the nice it was started with: no other library lowers its actors."""
    rows = WORKLOADS[wkey].rows(chunk, seed)
    out.put(None)  # ready
    start.wait()
    n, t0 = 0, time.perf_counter()
    while running(start, t0, seconds):
        if put(rows) is False:
            break
        n += chunk
    out.put((n, time.perf_counter() - t0))


def running(start, t0: float, seconds: float) -> bool:
    """An actor goes on while the learner runs: run_mp clears `start` when
    its learner loop ends.  Actors that stopped on their own clock could
    stop before the learner's last batch, and a queue's learner would then
    wait its whole timeout for items no one will insert (the qmp cells).
    The clock bound is for a learner that died without clearing it."""
    return start.is_set() and time.perf_counter() - t0 < 2 * seconds + 60


# ------------------------------------------------------------------ shared

FIRST_ITEM_S = 60.0  # the longest run_mp waits for the actors' first item


def run_mp(procs, start, out, seconds, sample_update, size) -> dict:
    """Start the actors; once every one has reported ready (None on `out`:
    attached, its rows built, its library imported), let them go, start
    the clock at the table's first item, run the learner loop for
    `seconds`, and collect each actor's item count."""
    for p in procs:
        p.start()
    deadline, ready = time.perf_counter() + 300, 0
    while ready < len(procs):
        try:
            ready += out.get(timeout=1.0) is None
        except queue.Empty:
            if time.perf_counter() > deadline or not all(p.is_alive() for p in procs):
                raise RuntimeError("actor processes did not get ready") from None
    start.set()
    try:
        # the clock starts at the first item: on a loaded box the actors'
        # first commits may take longer than a short cell's whole run
        guard = time.perf_counter() + FIRST_ITEM_S
        while size() == 0:
            if time.perf_counter() > guard:
                raise RuntimeError(f"no actor's item reached the table within {FIRST_ITEM_S:g} s")
            time.sleep(0.001)
        t0 = time.perf_counter()
        batches = 0
        while time.perf_counter() - t0 < seconds:
            sample_update()
            batches += 1
        learn_s = time.perf_counter() - t0
    finally:
        start.clear()  # the actors stop now (running())
    reports = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    # each actor's items over its own running time, summed
    return {"inserts_per_s": sum(n / s for n, s in reports), "batches_per_s": batches / learn_s}
