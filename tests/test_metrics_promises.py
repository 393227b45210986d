"""Issue 33, item 1: the Prometheus promises test_metrics.py left unchecked
(docs/operations.md, "Prometheus"): ``shmreplay_evictions_total`` counts
evictions, ``shmreplay_rate_limiter_waiting{kind="insert"}`` shows an insert
parked behind the limits, and the endpoint binds ``metrics_address``
(default 127.0.0.1; a bad one is refused with a message naming the key).
A real daemon, real client processes, real HTTP scrapes; the listening
socket's address is read from outside, in /proc/net/tcp."""

import os
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
import shmreplay  # noqa: E402
from conftest import shm_entries, write_config  # noqa: E402
from test_metrics import scrape  # noqa: E402
from waiting import HANG_S, reap, wait_for, worker_context  # noqa: E402

FIELDS = {"x": ("float32", (4,))}


def rows(n: int) -> dict:
    return {"x": np.ones((n, 4), np.float32)}


def scraped(url: str, what: str, pred) -> dict:
    """The first scrape that satisfies ``pred``: the endpoint serves the
    monitor's latest snapshot, taken once a second."""
    got = {}

    def ok():
        got.clear()
        got.update(scrape(url))
        return pred(got)
    wait_for(ok, what)
    return got


def test_evictions_total_counts_the_items_evicted_for_writers(start_daemon):
    """``shmreplay_evictions_total{table}`` (docs/operations.md, the metrics
    table): a full table evicts one item per item written, so a table of
    capacity 10 that took 13 items evicted 3; a table never full evicted
    none, under its own label."""
    d = start_daemon(metrics_port=0)
    with d.connect() as c:
        url = c.stats()["metrics"]
        full = c.create_table("full", 10, FIELDS, remover="fifo")
        roomy = c.create_table("roomy", 100, FIELDS)
        full.insert_batch(rows(10))
        full.insert_batch(rows(3))
        roomy.insert_batch(rows(13))
        c.flush()
        full_t, roomy_t = (("table", "full"),), (("table", "roomy"),)
        got = scraped(url, "a snapshot after all 26 inserts",
                      lambda m: m.get(("shmreplay_inserts_total", full_t)) == 13
                      and m.get(("shmreplay_inserts_total", roomy_t)) == 13)
        assert got[("shmreplay_evictions_total", full_t)] == 3
        assert got[("shmreplay_evictions_total", roomy_t)] == 0
        assert got[("shmreplay_table_items", full_t)] == 10


def _insert_one(sock: str) -> None:
    with shmreplay.connect(sock, timeout=HANG_S) as c:
        c.table("limited").insert(x=np.ones(4, np.float32), timeout=10 * HANG_S)  # a hang guard
        c.flush()


def test_the_insert_waiting_gauge_shows_an_insert_parked_behind_the_limits(start_daemon):
    """``shmreplay_rate_limiter_waiting{table, kind="insert"}`` (docs/operations.md,
    the metrics table; "actors held for ever mean the learner stopped
    sampling"): samples_per_insert 1 with max_diff 2 admits two inserts and
    holds the third until something samples.  A real client process parks
    in that third insert: the gauge reads 1 (and the sample gauge 0); one
    sample lets it in, and the gauge reads 0 again."""
    d = start_daemon(metrics_port=0)
    ctx = worker_context()
    writer = None
    with d.connect() as c:
        url = c.stats()["metrics"]
        t = c.create_table("limited", 100, FIELDS, sampler="uniform",
                           samples_per_insert=1.0, error_buffer=(0.0, 2.0))
        t.insert_batch(rows(2))
        c.flush()

        def limiter():
            return c.stats()["tables"]["limited"]["limiter"]
        try:
            writer = ctx.Process(target=_insert_one, args=(d.socket,), daemon=True)
            writer.start()
            wait_for(lambda: limiter()["waiting_inserts"] == 1, "the daemon to park the third insert")
            label = (("kind", "insert"), ("table", "limited"))
            sample_label = (("kind", "sample"), ("table", "limited"))
            # the client waits in 1 s slices, asking again after each: a
            # snapshot may fall between two, so wait for one that saw it parked
            got = scraped(url, "the gauge to show the parked insert",
                          lambda m: m.get(("shmreplay_rate_limiter_waiting", label)) == 1)
            assert got[("shmreplay_rate_limiter_waiting", sample_label)] == 0
            assert got[("shmreplay_inserts_total", (("table", "limited"),))] == 2
            assert writer.exitcode is None  # still waiting
            t.sample(1, timeout=HANG_S)  # the ratio now admits one more insert
            writer.join(HANG_S)
            assert writer.exitcode == 0
            # a snapshot that saw the third insert committed was taken after it left the queue
            got = scraped(url, "a snapshot after the third insert",
                          lambda m: m.get(("shmreplay_inserts_total", (("table", "limited"),))) == 3)
            assert got[("shmreplay_rate_limiter_waiting", label)] == 0
            assert limiter()["waiting_inserts"] == 0
        finally:
            reap([writer] if writer is not None else [])


def _ipv4(hex_addr: str) -> tuple[str, int]:
    """/proc/net/tcp's "0100007F:1F90": the address in host byte order, the port in hex."""
    addr, port = hex_addr.split(":")
    return socket.inet_ntoa(struct.pack("<I", int(addr, 16))), int(port, 16)


def listening(pid: int) -> list[tuple[str, int]]:
    """The TCP sockets process ``pid`` listens on, as the kernel lists them
    (IPv4 in /proc/net/tcp; an IPv6 one shows as its hex address)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                    out.append(_ipv4(local) if table.endswith("tcp") else (local, 0))
    return out


def test_the_endpoint_binds_metrics_address_and_only_that(start_daemon):
    """``metrics_address``, default ``127.0.0.1`` (docs/operations.md,
    "Prometheus"; daemon/shmreplayd.toml): the kernel's list of listening
    sockets shows the daemon's endpoint on exactly the configured address
    (127.0.0.2, a loopback address on Linux other than the default), and
    on 127.0.0.1 when the key is left out."""
    d = start_daemon(metrics_port=0, metrics_address="127.0.0.2")
    with d.connect() as c:
        url = c.stats()["metrics"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert url == f"http://127.0.0.2:{port}/metrics"
    assert listening(d.pid) == [("127.0.0.2", port)]
    assert scrape(url)[("shmreplay_up", ())] in (0, 1)  # it answers there
    default = start_daemon(metrics_port=0)
    with default.connect() as c:
        url = c.stats()["metrics"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert listening(default.pid) == [("127.0.0.1", port)]


def start_refused(tmp_path, name: str, **opts) -> subprocess.CompletedProcess:
    instance = f"test{os.getpid()}ma{name}"
    cfg = write_config(tmp_path / f"{name}.toml", instance=instance, socket=str(tmp_path / f"{name}.sock"),
                       metrics_port=0, **opts)
    p = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--config", cfg],
                       capture_output=True, text=True, timeout=120)  # a hang guard
    assert not shm_entries(f"shmreplay.{instance}."), "a daemon that did not start left objects"
    assert not (tmp_path / f"{name}.sock").exists()
    return p


def test_a_bad_metrics_address_is_refused_naming_the_key(tmp_path):
    """"a config error names the key and what to write" (docs/operations.md,
    "The daemon does not start"): a metrics_address that is no string is
    refused as the config is read (exit 2); one that is no address of this
    host (192.0.2.1: TEST-NET-1, RFC 5737, never a host's own) stops the
    daemon at startup (exit 1) with that message, not a traceback, and it
    leaves nothing behind."""
    p = start_refused(tmp_path, "num", metrics_address=5)
    assert p.returncode == 2, p.stderr
    assert "metrics_address must be a string" in p.stderr and "got 5" in p.stderr, p.stderr
    p = start_refused(tmp_path, "far", metrics_address="192.0.2.1")
    assert p.returncode == 1, p.stderr
    assert "cannot serve metrics at metrics_address '192.0.2.1'" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
