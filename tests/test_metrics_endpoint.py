"""Issue 34, item 3: the metrics endpoint is bounded and costs the data
path nothing (docs/operations.md, "Prometheus"; docs/reliability.md
section 11).  A real daemon, its real scrape process, real sockets: a
flood of half-open connections, slow and oversized requests, the TCP and
Unix endpoints, the scrape process's life."""

import os
import signal
import socket
import stat
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from test_metrics import scrape  # noqa: E402
from test_metrics_promises import FIELDS, rows, scraped, start_refused  # noqa: E402
from waiting import HANG_S, proc_stat, processes, wait_for  # noqa: E402

# ---- issue 34, item 3: the endpoint is bounded and costs the data path nothing ----
# The endpoint is served by a process of its own (server/control/scrapes.py):
# at most 64 connections (docs/operations.md, "Prometheus"), 2 s to send a
# request head of at most 8 KiB.

FLOOD = 1000        # connections: a few hundred past the bound, within CI's descriptors
MAX_CONNECTIONS = 64  # docs/operations.md
GROWTH = 16 << 20   # RSS a flood may add to the daemon or to the scrape process


def scrape_process(daemon_pid: int) -> int:
    """The pid of the daemon's scrape process (its one live child running scrapes.py)."""
    found = []
    for pid, fields in processes():
        if int(fields[1]) != daemon_pid or fields[0] == "Z":
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"shmreplay.server.control.scrapes" in f.read():
                    found.append(pid)
        except OSError:
            continue
    assert len(found) == 1, f"the daemon's scrape processes: {found}"
    return found[0]


def status_field(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def sockets(pid: int) -> int:
    """The process's open sockets (its other descriptors come and go: the
    monitor reads /proc/self/status every second)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def rss(pid: int) -> int:
    return status_field(pid, "VmRSS") * 1024


def host_port(url: str) -> tuple[str, int]:
    hostport = url.split("//", 1)[1].split("/", 1)[0]
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


def exchange(addr, data: bytes, family=socket.AF_INET) -> bytes:
    """Send ``data`` and read until the endpoint closes (a hang guard bounds it)."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(HANG_S)
        s.connect(addr)
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk


def raise_descriptor_limit(want: int) -> int:
    """Lift this process's soft RLIMIT_NOFILE towards ``want``; how many fit."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def insert_and_sample(t, c, n: int = 200) -> None:
    """The owner's data path: inserts, a flush, samples (each with the
    client's default timeouts: a stall past them raises ReplayTimeout)."""
    for _ in range(n // 50):
        t.insert_batch(rows(50))
    c.flush()
    for _ in range(20):
        assert len(t.sample(16).keys) == 16


def test_a_flood_of_half_open_connections_is_bounded_and_stalls_nothing(start_daemon):
    """Issue 34, item 3 (on 217752b: 10,000 half-open connections took the
    daemon to 3,037 threads and +80 MiB, and the owner's inserts stalled
    when they dropped).  ``FLOOD`` connections that never send a byte, all
    held open: the daemon gains no thread and no socket (they go to the
    scrape process), the scrape process keeps one thread and at most 64
    connections, neither grows by more than 16 MiB; a scrape made while
    every one of them is still open is answered (it pushes out the oldest),
    the owner's inserts and samples go on meanwhile and after the flood
    drops, and a scrape after it answers."""
    n = min(FLOOD, raise_descriptor_limit(FLOOD + 256) - 256)
    assert n > 2 * MAX_CONNECTIONS, f"too few descriptors for a flood: {n}"
    d = start_daemon(metrics_port=0)
    flood: list[socket.socket] = []
    with d.connect() as c:
        url = c.stats()["metrics"]
        t = c.create_table("t", 10_000, FIELDS)
        insert_and_sample(t, c)
        scraped(url, "a snapshot of the 200 items",
                lambda m: m.get(("shmreplay_table_items", (("table", "t"),))) == 200)
        child = scrape_process(d.pid)
        before = {"threads": threads(d.pid), "sockets": sockets(d.pid),
                  "rss": rss(d.pid), "child_rss": rss(child)}
        try:
            for _ in range(n):
                flood.append(socket.create_connection(host_port(url), timeout=HANG_S))
            during = {"threads": threads(d.pid), "sockets": sockets(d.pid),
                      "child_threads": threads(child), "child_fds": len(os.listdir(f"/proc/{child}/fd"))}
            # every connection still open, none has sent a byte: a scraper gets in
            got = scrape(url)
            assert got[("shmreplay_table_items", (("table", "t"),))] >= 200
            insert_and_sample(t, c)
            after_rss = {"rss": rss(d.pid), "child_rss": rss(child)}
        finally:
            for s in flood:
                s.close()
        insert_and_sample(t, c)  # right as the flood drops
        got = scrape(url)
        assert got[("shmreplay_up", ())] == 1
        assert during["threads"] == before["threads"], (before, during)
        assert during["sockets"] == before["sockets"], (before, during)
        assert during["child_threads"] == 1, during
        # stdin/out/err, the listening socket, the daemon's pair, epoll: 6
        assert during["child_fds"] <= MAX_CONNECTIONS + 6, during
        assert after_rss["rss"] - before["rss"] < GROWTH, (before, after_rss)
        assert after_rss["child_rss"] - before["child_rss"] < GROWTH, (before, after_rss)
        assert scrape_process(d.pid) == child  # the same process answered throughout


def test_a_slow_or_oversized_request_is_cut_off_and_only_get_metrics_is_answered(start_daemon):
    """A client that sends half a request head and waits gets 408 and is
    closed (it is never answered otherwise: without the deadline this read
    would run into the hang guard); a head over 8 KiB gets 431; any other
    path 404, another method 405, garbage 400; the endpoint answers after."""
    d = start_daemon(metrics_port=0)
    with d.connect() as c:
        url = c.stats()["metrics"]
    addr = host_port(url)
    assert exchange(addr, b"GET /metr").startswith(b"HTTP/1.1 408 ")
    assert exchange(addr, b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 9000).startswith(b"HTTP/1.1 431 ")
    assert exchange(addr, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert exchange(addr, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert exchange(addr, b"hello\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    ok = exchange(addr, b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 ") and b"\r\n\r\n# HELP shmreplay_up" in ok


def test_the_tcp_endpoint_can_leave_tables_out_and_the_unix_socket_has_them(start_daemon, tmp_path):
    """``metrics_tcp_tables = false``: the TCP endpoint (any local user
    reads it) answers without any per-table metric, so no table name; the
    Unix socket (``metrics_socket``) answers with them; the socket has the
    control socket's mode and goes at a clean stop."""
    path = str(tmp_path / "m.sock")
    d = start_daemon(metrics_port=0, metrics_socket=path, metrics_tcp_tables=False)
    with d.connect() as c:
        url = c.stats()["metrics"]
        c.create_table("secretname", 100, FIELDS).insert_batch(rows(3))
        c.flush()
    over_unix = wait_for(lambda: (lambda b: b if b"secretname" in b else None)(
        exchange(path, b"GET /metrics HTTP/1.1\r\n\r\n", socket.AF_UNIX)), "the table in the Unix answer")
    assert b'shmreplay_table_items{table="secretname"} 3.0' in over_unix
    over_tcp = urllib.request.urlopen(url, timeout=HANG_S).read()
    assert b"shmreplay_up 1.0" in over_tcp and b"secretname" not in over_tcp and b"table=" not in over_tcp
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    assert d.stop() == 0
    assert not os.path.exists(path)  # removed at a clean stop, as the control socket is


def test_the_scrape_process_is_replaced_if_it_dies_and_never_outlives_the_daemon(start_daemon):
    """The scrape process runs 10 nicer than the daemon and lives through a
    SIGTERM.  SIGKILL it: the daemon serves on, starts another, and
    scrapes answer again; SIGKILL the daemon: its scrape process exits
    (its pair with the daemon closed), leaving the port free."""
    d = start_daemon(metrics_port=0)
    with d.connect() as c:
        url = c.stats()["metrics"]
        first = scrape_process(d.pid)
        # it lowers its priority as it starts, before it answers: once it has answered,
        # it runs below the daemon's (its niceness 10 higher)
        wait_for(lambda: _answers(url), "a first answer")
        assert int(proc_stat(f"/proc/{first}/stat")[16]) == int(proc_stat(f"/proc/{d.pid}/stat")[16]) + 10
        # systemd's stop sends SIGTERM to every process of the unit: the daemon decides when it ends
        os.kill(first, signal.SIGTERM)
        assert _answers(url) and scrape_process(d.pid) == first
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: _answers(url), "a scrape answered by a new scrape process")
        second = scrape_process(d.pid)
        assert second != first
        assert c.stats()["metrics"] == url
    d.crash()
    wait_for(lambda: _zombie(second),
             "the scrape process to exit after its daemon")


def _answers(url: str) -> bool:
    try:
        return scrape(url)[("shmreplay_up", ())] == 1
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    """Gone, or exited and waiting for whoever inherited it to reap it."""
    fields = proc_stat(f"/proc/{pid}/stat")
    return fields is None or fields[0] == "Z"


def test_a_bad_metrics_socket_is_refused_naming_the_key(tmp_path):
    """``metrics_socket`` must be an absolute path (refused as the config is
    read, exit 2), in a directory only the daemon's user can write, as the
    control socket's must be: /tmp itself (anyone may create names there)
    stops the start (exit 1) with safedir's reason, nothing left behind."""
    p = start_refused(tmp_path, "rel", metrics_socket="m.sock")
    assert p.returncode == 2 and "metrics_socket must be an absolute path" in p.stderr, p.stderr
    p = start_refused(tmp_path, "tab", metrics_tcp_tables="no")
    assert p.returncode == 2 and "metrics_tcp_tables must be true or false" in p.stderr, p.stderr
    planted = f"/tmp/shmr{os.getpid()}metrics.sock"
    p = start_refused(tmp_path, "tmp", metrics_socket=planted)
    assert p.returncode == 1 and "/tmp is not a safe place" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not os.path.exists(planted)
