"""Issue 21, item 7: connect() survives bursts.  A full listen queue is
waited out within the connect's timeout (never a raw ``BlockingIOError``),
and 512 connections at once, half of them garbage, each end connected or
refused with a reason, while the daemon serves on."""

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shmreplay
from shmreplay.client import link

from faults import FIELDS, HANG_S, rows, wait_for
from people import ADMIN, ADMINS, GROUP, MEMBER, as_user, needs_root, users  # noqa: F401 (a fixture)


class _Watched:
    """``time`` as link.py sees it, telling the test when connect() pauses
    to try a full queue again (the pause itself is real)."""

    def __init__(self, retrying: threading.Event):
        self.retrying = retrying
        self.monotonic = time.monotonic

    def sleep(self, s):
        self.retrying.set()
        time.sleep(s)


def test_a_full_listen_queue_is_waited_out_within_the_timeout(start_daemon, monkeypatch):
    """The daemon SIGSTOPped and its listen queue filled to the brim (a
    non-blocking connect says EAGAIN): a connect with a short timeout
    raises ReplayTimeout naming the queue; one with a long timeout waits,
    and gets in once the daemon drains the queue.  Before, both raised
    BlockingIOError at once."""
    d = start_daemon(max_clients=4096, max_clients_per_user=4096, handshake_timeout_s=600.0)
    fill = []
    os.kill(d.pid, signal.SIGSTOP)
    try:
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(d.socket)
            except BlockingIOError:
                s.close()
                break
            fill.append(s)
        # the daemon listens with a backlog of 1,024 (docs/reliability.md, "bursts"), which the
        # kernel caps at net.core.somaxconn; a Unix socket's queue then takes one more than that
        with open("/proc/sys/net/core/somaxconn") as f:
            assert len(fill) == min(1024, int(f.read())) + 1, len(fill)
        with pytest.raises(shmreplay.ReplayTimeout, match="listen queue stayed full"):
            shmreplay.connect(d.socket, timeout=0.2)
        retrying, out = threading.Event(), {}
        monkeypatch.setattr(link, "time", _Watched(retrying))

        def late():
            try:
                out["client"] = shmreplay.connect(d.socket, timeout=HANG_S)
            except BaseException as exc:
                out["error"] = exc
        th = threading.Thread(target=late, daemon=True)
        th.start()
        assert retrying.wait(HANG_S)  # it found the queue full and is trying again
    finally:
        os.kill(d.pid, signal.SIGCONT)
    th.join(HANG_S)
    assert "error" not in out, out
    with out["client"] as c:
        c.create_table("t", capacity=8, fields=FIELDS).insert_batch(rows(np.arange(3)))
        c.flush()
        assert len(c.table("t")) == 3
        for s in fill:
            s.close()
        wait_for(lambda: c.stats()["connections"] == 1, "the queue's connections to end")


N = 256
PER_USER = 32


def real_clients(path, n, go_r):
    """As another user: ``n`` threads, each a full connect (handshake and a
    request), all started at once on the test's word; nobody closes before
    everyone has tried, so exactly max_clients_per_user get in."""
    outcome = [""] * n
    start, tried = threading.Barrier(n + 1, timeout=HANG_S), threading.Barrier(n, timeout=HANG_S)

    def one(i):
        start.wait()
        c = None
        try:
            c = shmreplay.connect(path, timeout=HANG_S)
            c.list_tables()
            outcome[i] = "connected"
        except shmreplay.ReplayError as exc:
            outcome[i] = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # a raw OSError: what this test is about
            outcome[i] = f"RAW {type(exc).__name__}: {exc}"
        tried.wait()
        if c is not None:
            c.close()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    os.read(go_r, 1)
    start.wait()
    for th in threads:
        th.join(HANG_S)
    return outcome


def garbage(path, n, go_r):
    """As a member: ``n`` connections at once on the test's word, every
    other one sending a zero-length frame (a protocol error), then closed."""
    os.read(go_r, 1)
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)  # blocking: a full queue is waited out
        if i % 2:
            try:
                s.sendall(b"\0\0\0\0")
            except OSError:  # refused and closed already
                pass
        socks.append(s)
    for s in socks:
        s.close()
    return len(socks)


@needs_root
def test_512_connections_at_once_are_each_connected_or_refused_with_a_reason(start_daemon, users):
    """256 real clients of one user and 256 garbage connections of another,
    started together.  max_clients_per_user 32 (and max_clients above both
    users' share) forces the outcome: exactly 32 real clients connect, the
    other 224 get CapacityError naming the limit; none raises a raw
    OSError; the daemon serves on."""
    sockdir = Path(tempfile.mkdtemp(prefix="shmrburst"))
    os.chmod(sockdir, 0o755)  # pytest's tmp dirs are 0700: other users could not reach a socket there
    d = start_daemon(socket_dir=sockdir, group=GROUP, admin_group=ADMINS, allowed_groups=[GROUP],
                     max_clients=3 * PER_USER, max_clients_per_user=PER_USER)
    try:
        burst(d, users)
    finally:
        d.stop()  # (start_daemon checks its exit and leftovers)
        shutil.rmtree(sockdir)


def burst(d, users):
    go_r, go_w = os.pipe()
    out = {}

    def run(key, user, fn):
        try:
            out[key] = as_user(users[user], fn, d.socket, N, go_r)
        except BaseException as exc:
            out[key] = exc
    threads = [threading.Thread(target=run, args=("real", ADMIN, real_clients), daemon=True),
               threading.Thread(target=run, args=("garbage", MEMBER, garbage), daemon=True)]
    for th in threads:
        th.start()
    os.write(go_w, b"gg")  # one byte each: both start at once
    for th in threads:
        th.join(2 * HANG_S)
    os.close(go_r)
    os.close(go_w)
    assert out.get("garbage") == N, out.get("garbage")
    outcome = out["real"]
    assert isinstance(outcome, list), outcome
    refused = [o for o in outcome if o != "connected"]
    assert not [o for o in refused if not o.startswith("CapacityError") or
                f"max_clients_per_user {PER_USER}" not in o], refused[:5]
    assert len(refused) == N - PER_USER
    with d.connect() as c:  # and the daemon serves on
        t = c.create_table("t", capacity=64, fields=FIELDS)
        t.insert_batch(rows(np.arange(8)))
        c.flush()
        assert len(t.sample(16)) == 16
        wait_for(lambda: c.stats()["connections"] == 1, "every burst connection to end")
        assert c.stats()["descriptors"]["refused_connections"] >= N - PER_USER
