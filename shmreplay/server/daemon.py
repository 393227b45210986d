"""``shmreplayd``: the daemon process, its startup and its shutdown.

Runs on the process's main thread, inside the uvloop event loop that also
runs the control plane (``control/server.py``); the engine (``engine/engine.py``) has its
own thread.  Signals are handled here and nowhere else.

Startup, in order (nothing is served until all of it succeeded):
  1. read the config; set up logging to stderr; raise the soft descriptor
     limit to the hard one (control/descriptors.py)
  2. compile the numba kernels, or load them from numba's cache
  3. take the instance lock in the runtime directory (a live daemon of
     this instance: refuse to start); remove channels dead daemons of older
     builds left in /dev/shm (this build's channels have no names)
  4. start the engine thread
  5. bring up the tables (control/recovery.py): adopt the segments a dead daemon
     left, else restore the newest checkpoint, else create them
  6. listen on the control socket; start periodic checkpoints and syncs;
     tell systemd READY=1, then ping its watchdog while the engine answers
     (control/watchdog.py)

Shutdown (SIGTERM, SIGINT or the admin ``shutdown`` op, all of which set
one event in ``Daemon.run``), in order:
  1. tell systemd STOPPING=1; stop periodic checkpoints and syncs; stop accepting
     connections; send every client a bye and close it; remove the socket
  2. end every lease: the engine applies what each ring still holds, then
     each client's channel and doorbells are closed
  3. drop every table through the engine: unmap its segments, and unlink
     them unless ``retain_tables`` (then the next daemon adopts them).
     A durable file-backed table is synced a last time and keeps its rows
     and metadata files either way (disk/durable.py).
     After an engine failure steps 2 and 3 touch nothing: every table
     stays for the next daemon, exactly as after a SIGKILL, and the exit
     code is 1
  4. stop the engine thread, then the prefetch readers (disk/prefetch.py),
     joining them and closing their descriptors
  5. release the instance lock
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import time

import numpy as np
import uvloop

from ..errors import ReplayError
from ..numbaconf import exit_without_teardown, without_blas_probe
from ..priorities import first_invalid_priority, priorities_fit
from ..version import __version__
from ..wire import atomics, commitrun
from ..wire.segment import shmem_huge_pages
from .control import descriptors, recovery
from .control.config import DaemonConfig, check_instance, load_config
from .control.server import ControlServer
from .control.watchdog import Watchdog, notify
from .disk import ownership
from .disk.prefetch import Prefetcher
from .engine.engine import Engine
from .tables.select import members, order, sumtree
from .tables.slots.slotqueue import is_run

log = logging.getLogger("shmreplayd")

PERIODIC_STOP_S = 10.0  # how long a stop waits for the tasks it cancelled


@without_blas_probe()  # ~0.2 s less per start: see numbaconf
def compile_kernels() -> float:
    """Run every kernel once on tiny inputs so clients never wait on the JIT."""
    t0 = time.monotonic()
    sums, mins = sumtree.new_trees(4)
    vals = np.ones(2)
    idx = np.array([0, 3], dtype=np.int64)
    sumtree.tree_values(vals, 0.5, vals)
    sumtree.tree_update(sums, mins, idx, vals)
    sumtree.tree_rebuild(sums, mins, vals)
    sumtree.tree_draw(sums, mins, np.zeros(2), 0.4, idx, vals, np.ones(2))
    sumtree.tree_check(sums, mins)
    first_invalid_priority(vals)
    priorities_fit(vals, 0.5)
    members.members_add(idx[:0], idx, 0, idx[:0])
    members.members_remove(idx[:0], idx, 0, idx[:0])
    words = np.zeros(16, dtype=np.uint64)
    atomics.store(words, 0, 1)
    atomics.load(words, 0)
    atomics.store_then_load(words, 0, 1, 8)
    atomics.spin_until_changed(words, 0, 1, 1)
    u0 = np.uint64(0)
    commitrun.commit_run(words.reshape(2, 8), 0, 0, 1, u0, u0, u0, 1, 2)
    is_run(idx)
    order.scan_live(words, 0, 1, 1, False, np.zeros(1, np.uint8), np.zeros(1, np.uint32), 2, words[:1].copy())
    return time.monotonic() - t0


class Daemon:
    def __init__(self, cfg: DaemonConfig, socket_path: str, restore_dir: str | None = None):
        self.cfg = cfg
        self.socket_path = socket_path
        self.restore_dir = restore_dir or cfg.checkpoint_dir or None
        self.lock: ownership.InstanceLock | None = None
        self.periodic: list[asyncio.Task] = []
        self.engine: Engine | None = None
        self.prefetcher: Prefetcher | None = None
        self.control: ControlServer | None = None
        self.stop_event: asyncio.Event | None = None
        self.failed = False
        self.started = False
        self.stop_reason = ""
        self.watchdog: Watchdog | None = None
        self.metrics = None  # control/metrics.py's MetricsServer, when metrics_port or metrics_socket is set

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_event.set()

    def _engine_crashed(self) -> None:  # engine thread
        self.failed = True
        self.control.loop.call_soon_threadsafe(self.stop_event.set)

    async def startup(self) -> None:
        log.info("shmreplayd %s starting (pid %d)", __version__, os.getpid())
        log.info("kernels ready in %.2f s", compile_kernels())
        mode = shmem_huge_pages()
        if mode not in ("advise", "always", "within_size", "force"):
            # only root can change it: tell root; anyone else reads it in the docs
            log.log(logging.INFO if os.geteuid() == 0 else logging.DEBUG,
                    "shared-memory huge pages are %r: learners gather large rows ~30%% slower "
                    "(docs/operations.md, 'Capacity planning': echo advise > "
                    "/sys/kernel/mm/transparent_hugepage/shmem_enabled)", mode)
        cfg = self.cfg
        descriptors.raise_limit()  # before anything is opened: clients and tables both need them
        self.lock = ownership.InstanceLock.acquire(cfg.instance)
        stale = ownership.remove_dead_channels(cfg.instance)  # we hold the lock: their daemon is dead
        if stale:
            log.info("removed %d channel(s) and doorbell(s) of a dead daemon", stale)
        # with prefetch_threads = 0 a pool that reads nothing (its stats say so)
        self.prefetcher = Prefetcher(cfg.prefetch_threads, cfg.prefetch_queue, cfg.prefetch_method)
        self.engine = Engine(cfg.spin_us, cfg.idle_timeout_s, prefetch=self.prefetcher,
                             learner_spin_us=cfg.learner_spin_us,
                             learner_spin_max_us=cfg.learner_spin_max_us)
        self.control = ControlServer(cfg, self.engine)
        self.control.request_shutdown = lambda: self._stop("shutdown requested")
        self.engine.on_client_error = self.control.on_client_error
        self.engine.on_crash = self._engine_crashed
        self.engine.start()
        self.control.loop = asyncio.get_running_loop()
        await recovery.open_tables(self.control, self.restore_dir)
        await self.control.start(self.socket_path)
        loop = asyncio.get_running_loop()
        if cfg.checkpoint_interval_s > 0:
            self.periodic.append(loop.create_task(self._checkpoint_periodically()))
        if cfg.sync_interval_s > 0 and cfg.durable_file_tables:
            self.periodic.append(loop.create_task(self._sync_periodically()))
        if cfg.metrics_port is not None or cfg.metrics_socket:
            # before ``started``: a start refused here (an address not of this
            # host, a port in use) keeps the tables it adopted, as any failed start
            from .control.metrics import MetricsServer  # prometheus_client only when asked for
            self.metrics = MetricsServer(cfg, self.control.monitor, self.control.checkpoints)
            self.control.metrics_url = self.metrics.url or f"unix:{self.metrics.path}"
            self.periodic.append(loop.create_task(self.metrics.run()))
            self.control.gate.recount()  # its listening sockets and its pair, held for good
        n = len(await self.control.call(self.engine.table_names))
        log.info("serving %s with %d table(s)", self.socket_path, n)
        self.started = True
        self.watchdog = Watchdog(self.control, self.engine)
        self.periodic.append(loop.create_task(self.watchdog.run()))
        self.periodic.append(loop.create_task(self.control.monitor.run()))
        notify("READY=1")

    async def _checkpoint_periodically(self) -> None:
        cfg = self.cfg
        while True:
            await asyncio.sleep(cfg.checkpoint_interval_s)
            try:
                await self.control.checkpoints.write([], cfg.checkpoint_dir, cfg.checkpoint_keep)
            except ReplayError as exc:  # a full disk must not take the replay service down
                log.error("periodic checkpoint failed: %s", exc)

    async def _sync_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sync_interval_s)
            for name in sorted(self.control.tables.syncs.locks):
                try:  # a stop cancels this wait, never the sync (control/syncs.py)
                    await self.control.tables.syncs.sync([name], forced=False)
                except ReplayError:  # logged; the next one tries again
                    pass

    async def shutdown(self) -> None:
        notify("STOPPING=1")
        await cancel_within(self.periodic, PERIODIC_STOP_S)
        if self.metrics is not None:
            await self.metrics.close()
        if self.control is not None:
            await self.control.close()                  # steps 1-2
            if self.failed:  # the tables stay exactly as they are, as after a SIGKILL
                log.error("engine failed: every table is left in /dev/shm for the next daemon")
            elif self.engine is not None and self.engine.thread is not None:
                # a start that failed half-way keeps the tables it adopted:
                # their data is what the next, fixed start must find
                await self.control.tables.drop_all(unlink=not self.cfg.retain_tables,
                                                  keep_adopted=not self.started)  # step 3
        if self.engine is not None:
            self.engine.stop()                          # step 4
        if self.prefetcher is not None:
            self.prefetcher.stop()
        if self.lock is not None:                       # step 5
            self.lock.release()
        log.info("stopped")

    async def run(self) -> None:
        stop = self.stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, "signal received")
        # the handlers stay through the stop (and main() ignores both signals
        # after it): a second SIGTERM during a stop, an impatient operator's,
        # changes nothing, where the default action would end it half-way
        try:
            await self.startup()
            await stop.wait()
            log.info("%s; shutting down", "engine failed" if self.failed else self.stop_reason)
        finally:
            await self.shutdown()


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


async def cancel_within(tasks, timeout: float) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout``: a task that
    survived its cancel (asyncio.wait_for before Python 3.12 could swallow
    one) is logged and left, never waited for without a bound; the tables
    are dropped and unlinked either way."""
    tasks = [t for t in tasks if not t.done()]
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    ended, stuck = await asyncio.wait(tasks, timeout=timeout)
    for t in ended:
        if not t.cancelled():
            t.exception()  # retrieved: it was logged where it rose
    for t in stuck:
        log.error("task %s did not end within %g s of its cancel; stopping without it", t.get_coro(), timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="shmreplayd", description="shared-memory replay daemon")
    ap.add_argument("--config", help="TOML config (tables and daemon settings)")
    ap.add_argument("--socket", help="control socket path (overrides config and $SHMREPLAY_SOCKET)")
    ap.add_argument("--instance", help="prefix of shared-memory names (overrides config)")
    ap.add_argument("--log-level", help="debug, info, warning (overrides config)")
    ap.add_argument("--metrics-port", type=int, metavar="PORT",
                    help="serve Prometheus metrics on PORT (0: any free port; overrides config)")
    ap.add_argument("--version", action="version", version=f"shmreplayd {__version__}")
    ap.add_argument("--restore", metavar="DIR",
                    help="restore tables from the newest checkpoints in DIR (default: checkpoint_dir)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.instance:
            cfg.instance = check_instance(args.instance)
        if args.metrics_port is not None:
            if not 0 <= args.metrics_port <= 65535:
                raise ReplayError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
            cfg.metrics_port = args.metrics_port
        socket_path = cfg.socket_path(args.socket)
    except ReplayError as exc:
        print(f"shmreplayd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=(args.log_level or cfg.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)  # its debug output is compiler IR
    # SIGUSR1 writes every thread's Python stack to the log (stderr) and the
    # daemon goes on: what an operator (or the suite, before it kills a
    # daemon that did not stop) reads to see where a stuck daemon waits.
    # faulthandler writes from the signal handler itself, so it works while
    # every thread is blocked, the event loop's included.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    daemon = Daemon(cfg, socket_path, args.restore)
    # not uvloop.run(): its runner waits, with no bound, for every task left
    # when run() returns, so one that ignored its cancel (see shutdown) would
    # keep a stopped daemon alive for ever; such a task was logged, and the
    # tables are already dropped: close the loop without waiting for it
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(daemon.run())
    except ReplayError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _ignore_stop_signals()  # stopped already: what is left is to exit
        loop.run_until_complete(cancel_within(asyncio.all_tasks(loop), PERIODIC_STOP_S))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()  # restores the default actions of the loop's signals
        _ignore_stop_signals()
        asyncio.set_event_loop(None)
    return 1 if daemon.failed else 0


if __name__ == "__main__":
    exit_without_teardown(main())  # ~0.25 s less per stop: see numbaconf
