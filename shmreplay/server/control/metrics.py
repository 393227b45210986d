"""Prometheus metrics at ``/metrics``: over TCP (``metrics_port``,
``--metrics-port``, on ``metrics_address``) and over a Unix socket
(``metrics_socket``) that only the users the control socket lets in may
read.

The daemon binds the endpoints and hands them to a process of their own
(``scrapes.py``, started with the daemon, ended with it), which accepts,
reads requests, and renders and sends the answers.  So whatever arrives at
the port (10,000 half-open connections, a client that sends a byte a
minute) costs the daemon no thread, no descriptor and no byte of memory,
and never holds the interpreter lock the engine thread needs: the daemon
only pushes each of the ``Monitor``'s snapshots (``monitor.py``, once a
second) down a socket pair, a few hundred bytes a table, skipping a push
while the last one is still on its way.  The scrape process's own bounds
(connections, deadlines, request size) are in ``scrapes.py``.

Metrics, labelled by ``table`` where they belong to one:

  shmreplay_table_items, shmreplay_table_capacity, shmreplay_table_bytes (gauges)
  shmreplay_inserts_total, shmreplay_samples_total (items),
  shmreplay_sample_calls_total (batches), shmreplay_priority_updates_total,
  shmreplay_evictions_total (counters)
  shmreplay_rate_limiter_waiting{table, kind="insert"|"sample"} (gauge:
      requests parked behind the limits now)
  shmreplay_sample_seconds (histogram: the engine's time per SAMPLE)
  shmreplay_checkpoint_last_success_timestamp_seconds (gauge; absent until one)
  shmreplay_clients, shmreplay_daemon_resident_bytes, shmreplay_up (gauges)

``metrics_tcp_tables = false`` leaves every per-table metric out of the TCP
endpoint's answer (any local user can read that one); the Unix socket's
answer always has them.

Who calls it: the daemon makes, feeds (a task on the event loop) and
closes the ``MetricsServer``; ``Collector`` and ``view_of`` are pure and
run in the scrape process (and ``view_of`` on the loop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import subprocess
import sys

from ...errors import ReplayError

log = logging.getLogger("shmreplayd")

HIST_BASE_S = 1.024e-6  # engine/commands.py: bucket k holds SAMPLEs under HIST_BASE_S * 2**k
FRAME = struct.Struct("<I")  # a pushed view: its length, then that many bytes of JSON
LISTEN_BACKLOG = 64  # connections the kernel queues for the scrape process; past it a SYN waits
RESPAWN_S = 5.0      # a scrape process that died is started again at most this often
STALL_S = 10.0       # a push not taken by then: the scrape process is wedged, and is killed
STOP_S = 5.0         # how long a stop waits for the scrape process before killing it

# what a scrape needs of each table's numbers, and nothing else (no client
# pids, no paths): the view the daemon pushes to the scrape process
_TABLE_KEYS = ("size", "capacity", "rows_bytes", "inserts", "samples", "sample_calls",
               "priority_updates", "evictions")


def view_of(latest, last_success: dict) -> dict | None:
    """The numbers a scrape shows, from the monitor's ``latest`` (None
    before the first snapshot) and the checkpoints' last successes."""
    if latest is None:
        return None
    _, snap = latest
    tables = {}
    for name, st in snap["tables"].items():
        t = {k: st[k] for k in _TABLE_KEYS}
        t["waiting"] = [st["limiter"]["waiting_inserts"], st["limiter"]["waiting_samples"]]
        h = st.get("sample_time")
        if h is not None:
            t["hist"] = [list(h["log2_us_buckets"]), h["sum_ns"]]
        tables[name] = t
    return {"tables": tables, "checkpoints": dict(last_success), "clients": snap["clients"],
            "rss": snap.get("memory", {}).get("rss_bytes", 0)}


class Collector:
    """prometheus_client's view of one pushed ``view_of`` (``view()``:
    the latest, or None); ``tables`` False leaves out per-table metrics."""

    def __init__(self, view, tables: bool = True):
        self.view, self.tables = view, tables

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        v = self.view()
        up = GaugeMetricFamily("shmreplay_up", "1 once the daemon has a snapshot of its tables")
        up.add_metric([], 0 if v is None else 1)
        yield up
        if v is None:
            return
        if self.tables:
            yield from self._tables(v)
        clients = GaugeMetricFamily("shmreplay_clients", "Clients attached")
        clients.add_metric([], v["clients"])
        yield clients
        rss = GaugeMetricFamily("shmreplay_daemon_resident_bytes", "The daemon's resident memory")
        rss.add_metric([], v["rss"])
        yield rss

    def _tables(self, v):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        tables, label = v["tables"], ["table"]

        def family(kind, name, doc, key):
            m = kind(name, doc, labels=label)
            for t, st in tables.items():
                m.add_metric([t], st[key])
            return m

        yield family(GaugeMetricFamily, "shmreplay_table_items", "Items in the table now", "size")
        yield family(GaugeMetricFamily, "shmreplay_table_capacity", "The table's capacity in items", "capacity")
        yield family(GaugeMetricFamily, "shmreplay_table_bytes",
                     "Bytes of the table's rows (shared memory or file)", "rows_bytes")
        yield family(CounterMetricFamily, "shmreplay_inserts", "Items committed", "inserts")
        yield family(CounterMetricFamily, "shmreplay_samples", "Items sampled (a batch of n counts n)", "samples")
        yield family(CounterMetricFamily, "shmreplay_sample_calls", "SAMPLE requests answered (batches)",
                     "sample_calls")
        yield family(CounterMetricFamily, "shmreplay_priority_updates", "Priorities updated", "priority_updates")
        yield family(CounterMetricFamily, "shmreplay_evictions", "Items evicted for writers", "evictions")
        waiting = GaugeMetricFamily("shmreplay_rate_limiter_waiting",
                                    "Requests parked behind the table's limits now", labels=["table", "kind"])
        for t, st in tables.items():
            waiting.add_metric([t, "insert"], st["waiting"][0])
            waiting.add_metric([t, "sample"], st["waiting"][1])
        yield waiting
        hist = HistogramMetricFamily("shmreplay_sample_seconds", "The engine's time per SAMPLE", labels=label)
        for t, st in tables.items():
            if "hist" not in st:
                continue
            counts, sum_ns = st["hist"]
            total, buckets = 0, []
            for k, c in enumerate(counts[:-1]):
                total += c
                buckets.append((repr(HIST_BASE_S * 2 ** k), total))
            buckets.append(("+Inf", total + counts[-1]))
            hist.add_metric([t], buckets, sum_value=sum_ns / 1e9)
        yield hist
        ck = GaugeMetricFamily("shmreplay_checkpoint_last_success_timestamp_seconds",
                               "Unix time of the table's last checkpoint written", labels=label)
        for t, at in v["checkpoints"].items():
            ck.add_metric([t], at)
        yield ck


def bind_tcp(address: str, port: int) -> socket.socket:
    """The TCP endpoint's listening socket; a config error names the keys."""
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, where = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:  # no such address here, a name that does not resolve, a port in use
        # a config error names the key and what to write (docs/operations.md,
        # "The daemon does not start"), not a traceback from the socket module
        raise ReplayError(f"cannot serve metrics at metrics_address {address!r}, metrics_port {port}: "
                          f"{exc}; set metrics_address to an address of this host (default "
                          f"127.0.0.1) and metrics_port to a free port (0: any)") from None
    return sock


def bind_unix(path: str, mode: int, gid: int) -> socket.socket:
    """The Unix endpoint, made as the control socket is: its directory
    checked (or made 0700), a stale socket replaced, a live one refused;
    then the socket's mode and group."""
    from .server import claim_socket_path
    claim_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    try:  # before listen: nobody connects while the mode is the umask's
        os.chmod(path, mode)
        os.chown(path, -1, gid)
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        from ...wire.rowfile import unlink_file_quiet
        unlink_file_quiet(path)
        raise
    return sock


class MetricsServer:
    """The endpoints and their scrape process.  ``port`` 0 takes any free
    port (``self.port``); ``cfg.metrics_socket`` adds the Unix endpoint."""

    def __init__(self, cfg, monitor, checkpoints):
        try:
            import prometheus_client  # noqa: F401  (the scrape process renders with it)
        except ImportError:
            raise ReplayError("metrics_port or metrics_socket is set but prometheus-client is not "
                              "installed: pip install 'shmreplay[metrics]' (or prometheus-client)") from None
        self.monitor, self.checkpoints = monitor, checkpoints
        self.address, self.port = cfg.metrics_address, None
        self.path: str | None = None  # the Unix endpoint, once bound here (and so ours to remove)
        self.listeners: list[socket.socket] = []
        self.proc: subprocess.Popen | None = None
        self.feed: socket.socket | None = None
        self.pushing: asyncio.Task | None = None
        self.last_spawn = 0.0
        self.closed = False
        try:
            if cfg.metrics_port is not None:
                self.listeners.append(bind_tcp(cfg.metrics_address, cfg.metrics_port))
                self.port = self.listeners[-1].getsockname()[1]
            if cfg.metrics_socket:
                self.listeners.append(bind_unix(cfg.metrics_socket, cfg.segment_mode, cfg.gid))
                self.path = cfg.metrics_socket
            self.rule = {"uids": sorted(cfg.allowed_uids), "gids": sorted(cfg.allowed_gids),
                         "tcp_tables": cfg.metrics_tcp_tables}
            self._spawn()
        except BaseException:
            self.close_sockets()
            raise
        if self.port is not None:
            log.info("metrics at http://%s:%d/metrics", self.address, self.port)
        if self.path:
            log.info("metrics at unix:%s (/metrics)", self.path)

    @property
    def url(self) -> str | None:
        return None if self.port is None else f"http://{self.address}:{self.port}/metrics"

    def _spawn(self) -> None:
        """Start the scrape process with the endpoints and one end of a
        new socket pair; it ends when that pair closes (the daemon stopped,
        or died)."""
        self.last_spawn = asyncio.get_running_loop().time()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        tcp = self.listeners[0] if self.port is not None else None
        unix = self.listeners[-1] if self.path else None
        spec = {"tcp": tcp.fileno() if tcp else -1, "unix": unix.fileno() if unix else -1,
                "feed": theirs.fileno(), **self.rule}
        # the same package the daemon runs, wherever it was imported from
        top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([top] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        # importing the package loads numpy, whose BLAS would start a pool of
        # a thread per core that the scrape process never uses
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shmreplay.server.control.scrapes", json.dumps(spec)],
                pass_fds=[s.fileno() for s in (tcp, unix, theirs) if s is not None],
                stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            ours.close()
            raise ReplayError(f"cannot start the metrics process: {exc}") from None
        finally:
            theirs.close()
        ours.setblocking(False)
        self.feed = ours

    async def run(self) -> None:
        """Push each new snapshot to the scrape process (an event-loop task)."""
        loop = asyncio.get_running_loop()
        pushed, since = None, 0.0
        while not self.closed:
            latest = self.monitor.latest
            if self.proc.poll() is not None and loop.time() - self.last_spawn >= RESPAWN_S:
                log.error("the metrics process exited (%s); starting it again", self.proc.returncode)
                self.feed.close()
                try:
                    self._spawn()
                except ReplayError as exc:  # tried again RESPAWN_S later; the daemon serves on
                    log.error("%s", exc)
                    self.proc = _Gone()
                pushed = None
            busy = self.pushing is not None and not self.pushing.done()
            if busy and loop.time() - since > STALL_S and self.proc.poll() is None:
                log.error("the metrics process took no snapshot for %g s; killing it", STALL_S)
                self.proc.kill()  # the push then fails, and the process is started again
            if latest is not pushed and not busy and self.proc.poll() is None:
                body = json.dumps(view_of(latest, self.checkpoints.last_success),
                                  default=_plain).encode()
                self.pushing = loop.create_task(self._push(self.feed, FRAME.pack(len(body)) + body))
                pushed, since = latest, loop.time()
            await asyncio.sleep(self.monitor.interval / 2)

    async def _push(self, feed: socket.socket, frame: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(feed, frame)
        except OSError:  # it died: run() starts another
            pass

    async def close(self) -> None:
        self.closed = True  # run() starts no other process
        if self.pushing is not None:
            self.pushing.cancel()
        if self.feed is not None:
            self.feed.close()  # the scrape process's cue to exit
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self.proc.wait),
                                       STOP_S)
            except asyncio.TimeoutError:
                log.error("the metrics process did not exit within %g s of its stop; killing it", STOP_S)
                self.proc.kill()
                self.proc.wait()
        self.close_sockets()

    def close_sockets(self) -> None:
        for s in self.listeners:
            s.close()
        self.listeners = []
        if self.path:
            from ...wire.rowfile import unlink_file_quiet
            unlink_file_quiet(self.path)


class _Gone:
    """In place of a scrape process that could not be started."""
    returncode = None

    def poll(self):
        return -1

    def kill(self):
        pass

    def wait(self, timeout=None):
        return -1


def _plain(o):
    """JSON for the engine's numpy numbers."""
    return o.tolist() if hasattr(o, "tolist") else int(o)
