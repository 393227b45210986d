"""Issue 24, items 2 and 3: the command line against a real daemon: the
status an operator reads (rates, limiter, checkpoint age, clients), top,
--json everywhere, shutdown's report, exit codes, --version; and what
``import shmreplay`` and the command line load (neither numba nor the
daemon's code)."""

import json
import os
import re
import subprocess
import sys

import numpy as np

import shmreplay
from waiting import wait_for

FIELDS = {"x": ("float32", (4,))}


def cli(*args, socket=None, code=0) -> str:
    cmd = [sys.executable, "-m", "shmreplay.cli", *(["--socket", socket] if socket else []), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == code, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    return run.stdout + run.stderr


def test_status_shows_tables_rates_limiter_checkpoints_and_clients(start_daemon, tmp_path):
    d = start_daemon(checkpoint_dir=str(tmp_path / "ck"))
    with d.connect() as c:
        t = c.create_table("replay", 1000, FIELDS)
        c.create_queue("q", 16, FIELDS)
        t.insert_batch({"x": np.ones((300, 4))})
        c.flush()
        c.checkpoint(str(tmp_path / "ck"), "replay")
        t.sample(8)

        def rated():  # inserts go on until a monitor interval that saw some has ended
            t.insert(x=np.ones(4))
            c.flush()
            return c.stats()["tables"]["replay"].get("inserts_per_s", 0) > 0
        wait_for(rated, "a rate over the last interval")
        size = len(t)
        out = cli("status", socket=d.socket)
        assert re.search(rf"^replay +{size} +1,000 ", out, re.M), out
        assert re.search(r"^q +0 +16 .*fifo/fifo .*samples held, 0 ins / 0 smp waiting +never$", out, re.M), out
        assert re.search(r"^replay .* s ago$", out, re.M), out          # checkpoint age
        assert f"pid {d.pid}" in out and "memory" in out and "clients 1" in out, out  # the CLI is no client
        assert re.search(rf"^\d+ +{os.getpid()} +{os.getuid()} +replay \(writes\+samples\)", out, re.M), out
        assert "q: limiter: table 'q' has no sampleable items" in out, out
        st = json.loads(cli("status", "--json", socket=d.socket))
        r = st["tables"]["replay"]
        assert r["size"] == size and r["last_checkpoint_age_s"] >= 0 and "inserts_per_s" in r
        assert st["clients"] == 1 and st["client_list"][0]["uid"] == os.getuid()
        assert st["memory"]["rss_bytes"] > 0 and st["version"] == shmreplay.__version__
        lines = cli("top", "--json", "--count", "2", "--interval", "0.01", socket=d.socket).splitlines()
        assert len(lines) == 2 and all(json.loads(x)["daemon_pid"] == d.pid for x in lines)
        screen = cli("top", "--count", "2", "--interval", "0.01", socket=d.socket)
        # a counted top ends by itself: no Ctrl-C hint (issue 38, item 5)
        assert "Ctrl-C" not in screen and "replay" in screen, screen
        assert "(every 0.01 s; screen 1 of 2)" in screen and "(every 0.01 s; screen 2 of 2)" in screen
        assert json.loads(cli("tables", "--json", socket=d.socket)) == ["replay", "q"]
        ck = json.loads(cli("checkpoint", "replay", "--to", str(tmp_path / "ck"), "--json", socket=d.socket))
        assert ck[0]["table"] == "replay" and ck[0]["items"] == size
        assert json.loads(cli("drop", "q", "--json", socket=d.socket)) == {"dropped": "q"}


def _cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks


def test_status_shows_the_daemons_cpu(start_daemon):
    """What a user weighs against a learner's threads (issue 36): the
    daemon's CPU seconds as the kernel counts them for its process, and the
    percent of a core over the monitor's last interval."""
    d = start_daemon()
    with d.connect() as c:
        t = c.create_table("replay", 1000, FIELDS)
        t.insert_batch({"x": np.ones((300, 4))})
        c.flush()
        lo = _cpu_s(d.pid)
        st = json.loads(cli("status", "--json", socket=d.socket))
        hi = _cpu_s(d.pid)
        tick = 1.0 / os.sysconf("SC_CLK_TCK")  # /proc counts whole ticks
        assert lo - tick <= st["cpu"]["seconds"] <= hi + tick, (lo, st["cpu"], hi)
        assert 0.0 <= st["cpu"]["percent"] <= 100.0 * os.cpu_count()
        out = cli("status", socket=d.socket)
        assert re.search(r"  cpu \d+% \([\d,.]+ s\)  ", out), out


def test_shutdown_says_what_it_stopped(start_daemon):
    d = start_daemon()
    with d.connect() as c:
        c.create_table("a", 100, FIELDS).insert_batch({"x": np.ones((7, 4))})
        c.flush()
    out = cli("shutdown", socket=d.socket)
    assert re.search(rf"shmreplayd pid {d.pid} \(instance {d.instance}\) stopped: 1 table\(s\) with 7 items "
                     r"\(a\), 0 client\(s\) disconnected", out), out
    assert d.proc.wait(60) == 0


def test_exit_codes_and_versions(tmp_path):
    out = cli("status", socket=str(tmp_path / "nobody.sock"), code=3)
    assert "shmreplay:" in out
    cli("frobnicate", code=2)
    assert cli("--version").strip() == f"shmreplay {shmreplay.__version__}"
    run = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"shmreplayd {shmreplay.__version__}"


def test_import_and_the_command_line_load_neither_numba_nor_the_daemon(start_daemon):
    code = ("import sys, shmreplay\n"
            "assert 'numba' not in sys.modules, 'import shmreplay loaded numba'\n"
            "assert not [m for m in sys.modules if m.startswith('shmreplay.server')]\n"
            "from shmreplay.cli import main\n"
            "assert main(['--socket', sys.argv[1], 'status', '--json']) == 0\n"
            "assert 'numba' not in sys.modules, 'the command line loaded numba'\n"
            "assert not [m for m in sys.modules if m.startswith('shmreplay.server')]\n")
    d = start_daemon()
    run = subprocess.run([sys.executable, "-c", code, d.socket], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_an_admin_hello_makes_no_client_and_a_bad_one_is_refused(start_daemon):
    from shmreplay.client.link import ControlLink
    from shmreplay.wire.control import PROTOCOL_VERSION
    d = start_daemon()
    link = ControlLink(d.socket, 30.0)
    try:
        reply = link.admin_hello()
        assert reply["fds"] == [] and not link.fds
        assert link.request("stats")["clients"] == 0
    finally:
        link.close()
    bad = ControlLink(d.socket, 30.0)
    try:
        try:
            bad.request("hello", protocol=PROTOCOL_VERSION, pid=os.getpid(), channel="no")
        except shmreplay.ReplayError as exc:
            assert "channel must be a bool" in str(exc)
        else:
            raise AssertionError("a non-bool channel was accepted")
    finally:
        bad.close()


def test_under_systemds_cache_directory_kernels_are_cached_there(start_daemon, tmp_path):
    """CacheDirectory= gives $CACHE_DIRECTORY; with no NUMBA_CACHE_DIR the
    daemon caches its kernels there (site-packages is read-only under the
    unit), so the second start loads them."""
    cache = tmp_path / "cache"
    cache.mkdir()
    import conftest
    d = conftest.DaemonProcess(tmp_path, env={"CACHE_DIRECTORY": str(cache), "NUMBA_CACHE_DIR": ""})
    try:
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.kill()
    found = [f for _, _, files in os.walk(cache / "numba") for f in files if f.endswith(".nbi")]
    assert found, "no kernel index in $CACHE_DIRECTORY/numba"
