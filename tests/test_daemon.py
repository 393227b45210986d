"""The daemon process: its config (tables, every limit), start and
shutdown as a client sees them (none there, stopping), idle cost, timeouts
when it hangs, a second daemon refused, systemd, fork and spawn."""

import dataclasses
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import shmreplay
from conftest import ROOT, SMALL_FIELDS, shm_entries, write_config
from items import TABLE, good_row, ids, insert_ids
from waiting import HANG_S, all_threads_stopped, thread_states, wait_for
from shmreplay.server.control.config import DAEMON_KEYS, DaemonConfig, load_config, parse_config
from shmreplay.wire.names import lock_path
from shmreplay.wire.peer import process_state


def test_tables_from_config_exist_at_start(start_daemon):
    d = start_daemon(tables=[TABLE])
    with d.connect() as c:
        t = c.table("cfg")
        assert t.spec.sampler == "uniform" and t.capacity == 100
        assert t.spec.field("obs").shape == (4, 8, 8)


def test_every_limit_is_settable_in_the_daemon_config(start_daemon):
    tables = [
        {"name": "impala", "capacity": 64, "sampler": "fifo", "remover": "fifo",
         "max_times_sampled": 1, "samples_per_insert": 1.0, "error_buffer": [0.0, 64.0],
         "fields": {"v": ("int64", ())}},
        {"name": "apex", "capacity": 100, "sampler": "prioritized", "alpha": 0.9,
         "remover": "lifo", "min_size_to_sample": 10, "samples_per_insert": 8.0,
         "error_buffer": 40.0, "fields": {"v": ("int64", ())}},
    ]
    d = start_daemon(tables=tables)
    with d.connect() as c:
        q, a = c.table("impala"), c.table("apex")
        assert (q.spec.sampler, q.spec.max_times_sampled, q.spec.diff_bounds) == ("fifo", 1, (0.0, 64.0))
        assert (a.spec.remover, a.spec.min_size_to_sample, a.spec.diff_bounds) == ("lifo", 10, (40.0, 120.0))
        insert_ids(q, 0, 3)
        assert ids(q.sample(3)) == [0, 1, 2] and len(q) == 0
        with pytest.raises(shmreplay.RateLimited, match="min_size_to_sample 10"):
            a.sample(1, timeout=0)


def test_sigterm_unlinks_every_segment_and_semaphore(start_daemon):
    d = start_daemon(tables=[TABLE])
    c = d.connect()
    c.table("cfg").insert(**good_row(1))
    c.create_table("extra", capacity=10, fields=SMALL_FIELDS)
    mine = shm_entries(f"shmreplay.{d.instance}.")
    assert any(".t.cfg" in n for n in mine) and any(".r.extra" in n for n in mine)
    assert d.stop() == 0
    assert shm_entries(f"shmreplay.{d.instance}.") == set()
    assert not os.path.exists(d.socket) and not os.path.exists(lock_path(d.instance))
    assert "signal received; shutting down" in d.log()
    c.close()


def test_stopped_daemon_says_it_is_shutting_down(start_daemon):
    d = start_daemon()
    c = d.connect()
    t = c.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert d.stop() == 0
    with pytest.raises(shmreplay.DaemonUnavailable, match="shutting down|closed the connection"):
        t.insert(**good_row())
    c.close()


def test_no_daemon_is_daemon_unavailable(tmp_path):
    with pytest.raises(shmreplay.DaemonUnavailable, match="no shmreplay daemon at"):
        shmreplay.connect(str(tmp_path / "nothing.sock"))


def test_channel_names_are_unlinked_once_the_client_attached(start_daemon):
    d = start_daemon()
    before = shm_entries(f"shmreplay.{d.instance}.")
    with d.connect():
        assert shm_entries(f"shmreplay.{d.instance}.") == before, "channel objects must not stay named"


def test_an_idle_daemon_blocks_in_the_kernel_and_wakes_only_at_its_idle_timeout(start_daemon):
    """An attached, idle client: the daemon uses no CPU while nobody asks
    anything.  Shown by state, not by a CPU-time budget (which a loaded
    box blows either way): every thread of the daemon is found blocked in
    the kernel at one moment (a thread that spins is always runnable, so
    the wait below would end in its hang guard), the engine in epoll; and
    across a window the sleeps that no doorbell ended are no more than its
    idle timeout (1 s, the default) allows, and no client rang.  The
    timeout is a lower bound on each sleep, so a loaded box only makes the
    count smaller."""
    d = start_daemon(tables=[TABLE])
    with d.connect() as c:
        c.table("cfg").insert(**good_row(1))
        c.flush()
        seen = wait_for(lambda: (s := thread_states(d.pid)) and all(st == "S" for st, _ in s.values()) and s,
                        "every daemon thread to block in the kernel at once")
        assert any(w == "do_epoll_wait" for _, w in seen.values()), seen  # the engine, asleep on its doorbells
        t0 = time.monotonic()
        before = c.stats()["engine"]
        time.sleep(2.0)  # the window; its length only loosens the bound
        after = c.stats()["engine"]
        window = time.monotonic() - t0
        # sleeps a doorbell did not end ran to the idle timeout (1 s) each; the control
        # plane's rings (its monitor's look each second, the stats calls) end the others
        timed_out = (after["sleeps"] - after["wakeups"]) - (before["sleeps"] - before["wakeups"])
        assert timed_out <= window / 1.0 + 1, (timed_out, window, before, after)
        assert after["client_wakeups"] == before["client_wakeups"]  # no client rang
        assert after["commands"] == before["commands"]


def test_engine_stays_awake_for_a_busy_learner_and_sleeps_once_it_stops(start_daemon):
    """A learner sampling back to back finds the engine awake (it spins
    past its own budget for the learner), and once the learner stops the
    engine goes back to sleep: busy-polling never outlives the learner.
    ``learner_spin_us`` is one second here, so on any machine load the
    learner's gaps are under it; ``spin_us`` 0 leaves only the learner rule."""
    d = start_daemon(tables=[TABLE], spin_us=0, learner_spin_us=1e6)
    with d.connect() as c:
        t = c.table("cfg")
        for i in range(8):
            t.insert(**good_row(i))
        c.flush()
        before = c.stats()["engine"]
        for _ in range(20):
            t.sample(4)
        during = c.stats()["engine"]
        assert during["learner_spins"] > before["learner_spins"], during
        # no more samples: at most two intervals later the engine sleeps
        wait_for(lambda: c.stats()["engine"]["sleeps"] > during["sleeps"] + 1,
                 "the engine to sleep once the learner stopped")


def test_every_wait_has_a_timeout(start_daemon):
    d = start_daemon(tables=[TABLE])
    c = d.connect(timeout=1.0)
    t = c.table("cfg")
    t.insert(**good_row(1))
    c.flush()
    os.kill(d.pid, signal.SIGSTOP)
    try:
        # kill() returns before the stop takes hold: on a loaded box the
        # engine could still answer; wait until every thread is stopped
        wait_for(lambda: all_threads_stopped(d.pid), "the daemon to stop")
        t0 = time.monotonic()
        with pytest.raises(shmreplay.ReplayTimeout, match="within 1.0 s"):
            t.sample(1)
        assert time.monotonic() - t0 < HANG_S  # a hang guard, not a speed test
        with pytest.raises(shmreplay.ReplayTimeout):
            c.stats()
    finally:
        os.kill(d.pid, signal.SIGCONT)
    c.close()


def test_the_bundled_config_documents_every_key_and_its_default():
    """daemon/shmreplayd.toml says "the values below are the defaults unless
    noted": each [daemon] value it sets must be the one a config without it
    gets, and every key must appear there (set, or commented out where it
    has no value by default)."""
    path = os.path.join(ROOT, "daemon", "shmreplayd.toml")
    with open(path) as f:
        text = f.read()
    undocumented = sorted(k for k in DAEMON_KEYS if not re.search(rf"^#? ?{k} = ", text, re.M))
    assert not undocumented, f"{path} does not mention {undocumented}"
    bundled = dataclasses.replace(load_config(path), tables=[])  # its demo table is no default
    fields = dataclasses.asdict  # a failure names the field that differs
    assert fields(bundled) == fields(parse_config({})) == fields(DaemonConfig())


def test_the_operations_page_documents_every_key():
    """docs/operations.md, "Configuration keys", is where users read what
    each [daemon] key does: every key has its row there (``seed`` once had
    none), and no row names a key the daemon does not know."""
    path = os.path.join(ROOT, "docs", "operations.md")
    with open(path) as f:
        text = f.read()
    section = text.split("## Configuration keys\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    named = set(re.findall(r"`([a-z_]+)`", " ".join(rows)))
    assert not DAEMON_KEYS - named, f"{path} has no row for {sorted(DAEMON_KEYS - named)}"
    assert not named - DAEMON_KEYS, f"{path} documents keys the daemon lacks: {sorted(named - DAEMON_KEYS)}"


def test_bad_config_exits_with_a_message(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[daemon]\ninstance = "x"\nspin_usec = 3\n')
    out = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown [daemon] keys ['spin_usec']" in out.stderr
    cfg = write_config(tmp_path / "bad2.toml", tables=[dict(TABLE, capacity=-5)], instance="x")
    out = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--config", cfg],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "capacity -5 outside" in out.stderr
    for bad in ("-1", "inf", '"soon"'):  # a negative one made the idle engine sleep for ever
        path.write_text(f'[daemon]\ninstance = "x"\nidle_timeout_s = {bad}\n')
        out = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--config", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "idle_timeout_s must be a number in 0.001..3600" in out.stderr, out.stderr
    long = str(tmp_path / ("s" * 120) / "d.sock")  # past the 107 bytes of a Unix socket's path
    out = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--socket", long],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "a Unix socket's path may have at most 107: choose a shorter" in out.stderr, \
        out.stderr


def test_second_daemon_on_the_same_socket_is_refused(start_daemon, tmp_path):
    d = start_daemon()
    cfg = write_config(tmp_path / "second.toml", instance=f"test{os.getpid()}second", socket=d.socket)
    out = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--config", cfg],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "another daemon is serving" in out.stderr
    assert not shm_entries(f"shmreplay.test{os.getpid()}second.")


def test_a_crashed_daemon_nobody_reaped_leaves_its_tables_to_the_next(start_daemon):
    """A killed daemon whose parent never waits for it (a container whose
    init reaps nothing) stays a zombie: it maps and runs nothing, so the
    next daemon adopts its tables as after any crash."""
    d = start_daemon(tables=[TABLE], env={"SHMREPLAY_TEST_OWN_CHILD": "1"})  # this process's child
    with d.connect() as c:
        for i in range(5):
            c.table("cfg").insert(**good_row(i))
        c.flush()
    old = d.proc
    os.kill(old.pid, signal.SIGKILL)
    try:
        wait_for(lambda: process_state(old.pid)[0] == "Z", "the killed daemon to be a zombie")
        d.start()
        with d.connect() as c:
            assert len(c.table("cfg")) == 5 and not c.stats()["set_aside"]
    finally:
        old.wait(HANG_S)


def test_client_reattaches_after_fork(start_daemon):
    d = start_daemon(tables=[TABLE])
    c = d.connect()
    t = c.table("cfg")
    t.insert(**good_row(1))
    c.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: same objects, new lease
        code = 1
        try:
            t.insert(**good_row(2))
            t.flush()
            code = 0 if len(t) == 2 and c._session.pid == os.getpid() else 3
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    assert os.read(r, 1) == b"\x00"
    os.waitpid(pid, 0)
    t.insert(**good_row(3))  # the parent's lease is untouched
    c.flush()
    assert len(t) == 3
    c.close()


def spawned_writer(table, n):
    for i in range(n):
        table.insert(**good_row(100 + i))
    table.flush()


def test_client_and_table_work_in_spawned_processes(start_daemon):
    d = start_daemon(tables=[TABLE])
    with d.connect() as c:
        t = c.table("cfg")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=spawned_writer, args=(t, 10)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert len(t) == 20
        assert set(t.sample(200).data["action"].tolist()) <= set(range(100, 110))


def test_tells_systemd_when_ready_and_when_stopping(tmp_path):
    import socket as so
    addr = str(tmp_path / "notify.sock")
    sink = so.socket(so.AF_UNIX, so.SOCK_DGRAM)
    sink.bind(addr)
    sink.settimeout(120)
    cfg = write_config(tmp_path / "n.toml", instance=f"test{os.getpid()}notify",
                       socket=str(tmp_path / "n.sock"))
    proc = subprocess.Popen([sys.executable, "-m", "shmreplay.server.daemon", "--config", cfg],
                            env=dict(os.environ, NOTIFY_SOCKET=addr), stderr=subprocess.DEVNULL)
    try:
        assert sink.recv(256) == b"READY=1"
        with shmreplay.connect(str(tmp_path / "n.sock")) as c:  # READY means serving
            assert c.stats()["daemon_pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        msg = sink.recv(256)
        while msg.startswith(b"STATUS="):  # refreshed every 10 s without a watchdog
            msg = sink.recv(256)
        assert msg == b"STOPPING=1"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sink.close()


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_daemon_serves_on(start_daemon):
    """docs/operations.md, "A daemon that does not stop": SIGUSR1 dumps the
    Python stack of each thread (the suite reads it before it kills a
    daemon that did not stop: conftest's DaemonProcess.dump_threads)."""
    d = start_daemon(tables=[TABLE])
    dump = d.dump_threads()
    assert "Current thread" in dump or "Thread 0x" in dump, dump
    assert dump.count("Thread 0x") + dump.count("Current thread 0x") >= 3, dump  # main, engine, control
    assert "engine" in dump and "state S" in dump, dump  # the engine thread's frames; /proc states
    with d.connect() as c:
        c.table("cfg").insert(**good_row(1))
        c.flush()
        assert len(c.table("cfg")) == 1


HELLO_PROBE = """
import sys
import shmreplay
from shmreplay.client import link
from shmreplay.wire import atomics
hello = link.ControlLink.hello
def probe(self, *args):
    # the spin calibration (a numba kernel loaded or compiled) is done before the handshake starts
    print("calibrated before hello:", atomics._loads_per_s is not None, flush=True)
    return hello(self, *args)
link.ControlLink.hello = probe
with shmreplay.connect(sys.argv[1]) as c:
    print("tables:", c.list_tables())
"""


def test_a_new_process_loads_its_kernel_before_the_handshake_not_inside_it(start_daemon):
    """The daemon closes a connection that has not said hello and ready
    within handshake_timeout_s (10 s).  A new process's first connect
    loads (or compiles) the numba kernel it spins with: up to seconds on a
    loaded box, which once fell inside the handshake and got a Ray actor
    refused ("no hello and ready within 10 s").  It is loaded before the
    connect now."""
    d = start_daemon(tables=[TABLE])
    out = subprocess.run([sys.executable, "-c", HELLO_PROBE, d.socket], capture_output=True, text=True,
                         timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert "calibrated before hello: True" in out.stdout and "tables: ['cfg']" in out.stdout, out.stdout
