"""``shmreplayd``: the daemon process, its startup and its shutdown.

Startup, in order (nothing is served until all of it succeeded):
  1. read the config; set up logging to stderr
  2. compile the numba kernels, or load them from numba's cache
  3. create the doorbell semaphore and start the engine thread
  4. create the tables the config declares (reserving their memory)
  5. listen on the control socket; tell systemd READY=1

Shutdown (SIGTERM or SIGINT, handled in ``Daemon.run`` only), in order:
  1. tell systemd STOPPING=1; stop accepting connections; send every
     client a bye and close it; remove the socket file
  2. end every lease: the engine applies what each ring still holds and
     unlinks each client's channel
  3. drop every table through the engine: unlink and unmap its segment
  4. stop the engine thread
  5. unlink the doorbell semaphore
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time

import numpy as np
import posix_ipc
import uvloop

from . import __version__, atomics, sumtree
from .config import DaemonConfig, check_instance, load_config
from .engine import Engine
from .errors import ReplayError
from .segment import shmem_huge_pages
from .segment import unlink_semaphore_quiet
from .server import ControlServer

log = logging.getLogger("shmreplayd")


def compile_kernels() -> float:
    """Run every kernel once on tiny inputs so clients never wait on the JIT."""
    t0 = time.monotonic()
    sums, mins = sumtree.new_trees(4)
    vals = np.ones(2)
    idx = np.array([0, 3], dtype=np.int64)
    sumtree.tree_values(vals, 0.5, vals)
    sumtree.tree_update(sums, mins, idx, vals)
    sumtree.tree_rebuild(sums, mins, vals)
    sumtree.tree_sample_stratified(sums, np.zeros(2), idx, vals)
    sumtree.tree_check(sums, mins)
    sumtree.first_invalid_priority(vals)
    words = np.zeros(16, dtype=np.uint64)
    atomics.store(words, 0, 1)
    atomics.load(words, 0)
    atomics.store_then_load(words, 0, 1, 8)
    atomics.spin_until_changed(words, 0, 1, 1)
    return time.monotonic() - t0


def sd_notify(state: str) -> None:
    """systemd's notify protocol; a no-op when not run by systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
            s.sendall(state.encode())
        except OSError as exc:
            log.warning("sd_notify(%s) failed: %s", state, exc)


class Daemon:
    def __init__(self, cfg: DaemonConfig, socket_path: str):
        self.cfg = cfg
        self.socket_path = socket_path
        self.doorbell: posix_ipc.Semaphore | None = None
        self.engine: Engine | None = None
        self.control: ControlServer | None = None
        self.stop_event: asyncio.Event | None = None
        self.failed = False

    def _engine_crashed(self) -> None:  # engine thread
        self.failed = True
        self.control.loop.call_soon_threadsafe(self.stop_event.set)

    async def startup(self) -> None:
        log.info("shmreplayd %s starting (pid %d)", __version__, os.getpid())
        log.info("kernels ready in %.2f s", compile_kernels())
        mode = shmem_huge_pages()
        if mode not in ("advise", "always", "within_size", "force"):
            log.info("shared-memory huge pages are %r: learners gather large rows ~30%% slower; "
                     "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled", mode)
        self.doorbell = posix_ipc.Semaphore(self.cfg.doorbell(os.getpid()), posix_ipc.O_CREX,
                                            self.cfg.segment_mode, 0)
        self.engine = Engine(self.doorbell, self.cfg.spin_us, self.cfg.idle_timeout_s)
        self.control = ControlServer(self.cfg, self.engine)
        self.engine.on_client_error = self.control.on_client_error
        self.engine.on_crash = self._engine_crashed
        self.engine.start()
        self.control.loop = asyncio.get_running_loop()
        for spec in self.cfg.tables:
            await self.control.add_table(spec)
        await self.control.start(self.socket_path)
        log.info("serving %s with %d table(s)", self.socket_path, len(self.cfg.tables))
        sd_notify("READY=1")

    async def shutdown(self) -> None:
        sd_notify("STOPPING=1")
        if self.control is not None:
            await self.control.close()                  # steps 1-2
            if self.engine is not None and self.engine.thread is not None:
                await self.control.drop_all_tables()    # step 3
        if self.engine is not None:
            self.engine.stop()                          # step 4
        if self.doorbell is not None:                   # step 5
            unlink_semaphore_quiet(self.doorbell.name)
            self.doorbell.close()
        log.info("stopped")

    async def run(self) -> None:
        stop = self.stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.startup()
            await stop.wait()
            log.info("engine failed; shutting down" if self.failed else "signal received; shutting down")
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="shmreplayd", description="shared-memory replay daemon")
    ap.add_argument("--config", help="TOML config (tables and daemon settings)")
    ap.add_argument("--socket", help="control socket path (overrides config and $SHMREPLAY_SOCKET)")
    ap.add_argument("--instance", help="prefix of shared-memory names (overrides config)")
    ap.add_argument("--log-level", help="debug, info, warning (overrides config)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.instance:
            cfg.instance = check_instance(args.instance)
    except ReplayError as exc:
        print(f"shmreplayd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=(args.log_level or cfg.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("numba").setLevel(logging.WARNING)  # its debug output is compiler IR
    daemon = Daemon(cfg, cfg.socket_path(args.socket))
    try:
        uvloop.run(daemon.run())
    except ReplayError as exc:
        log.error("%s", exc)
        return 1
    return 1 if daemon.failed else 0


if __name__ == "__main__":
    sys.exit(main())
