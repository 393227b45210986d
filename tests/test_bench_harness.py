"""The benchmark harness still runs (no speed is asserted: benchmarks are
not tests).  One tiny cell per kind, shmreplay only (cpprb is not a test
dependency)."""

import json
import os
import subprocess
import sys
import time

import pytest

from daemons import checkout_env


@pytest.mark.parametrize("cell, keys", [
    ("insert64", {"items_per_s", "MB_per_s"}),
    ("sample_it", {"batches_per_s", "GB_per_s"}),
    ("qmp2", {"batches_per_s", "inserts_per_s"}),  # a queue fed by 2 actor processes
    ("mp3", {"batches_per_s", "inserts_per_s"}),   # any number of actors (many_cores.py: 8, 12)
])
def test_a_cell_runs_in_its_own_process_and_reports_json(cell, keys):
    out = subprocess.run([sys.executable, "-m", "shmreplay.bench.cells", cell, "shmreplay",
                          "sac-mujoco", "--seconds", "0.2"], env=checkout_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert keys <= res.keys() and all(res[k] > 0 for k in keys)


def _check(results):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")
    spec = importlib.util.spec_from_file_location("bench_run", path)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run.check_targets({"results": results})


def test_target_check_tells_a_slow_cell_from_one_beyond_the_machine():
    r2d2_item = 564_480
    lines = _check([
        {"cell": "copy", "peer": "numpy", "workload": "-", "GB_per_s": 20.0},
        # cpprb already writes 25 GB/s of r2d2 rows: 2x that is 51 GB/s
        {"cell": "insert64", "peer": "cpprb", "workload": "r2d2-seq", "items_per_s": 25e9 / r2d2_item},
        {"cell": "insert64", "peer": "shmreplay", "workload": "r2d2-seq", "items_per_s": 24e9 / r2d2_item},
        # sac rows: 2x cpprb is well inside the machine
        {"cell": "insert64", "peer": "cpprb", "workload": "sac-mujoco", "items_per_s": 3e6},
        {"cell": "insert64", "peer": "shmreplay", "workload": "sac-mujoco", "items_per_s": 4.5e6},
        {"cell": "sample", "peer": "cpprb", "workload": "sac-mujoco", "batches_per_s": 2500.0},
        {"cell": "sample", "peer": "shmreplay", "workload": "sac-mujoco", "batches_per_s": 5100.0},
    ])
    by_cell = {" ".join(line.split()[1:3]): line for line in lines}
    assert by_cell["r2d2-seq insert64"].startswith("MISS")
    assert "beyond this machine: needs 50.0 GB/s" in by_cell["r2d2-seq insert64"]
    assert by_cell["sac-mujoco insert64"].startswith("MISS")
    assert "beyond" not in by_cell["sac-mujoco insert64"]
    assert by_cell["sac-mujoco sample"].startswith("PASS")


def test_capacity_cells_and_report_run_on_a_small_file(tmp_path):
    """benchmarks/capacity.py's disk cells on a few rows (not cold: no page
    cache is dropped here), and its table and target lines."""
    import os
    from benchmarks.harness import disk
    path = str(tmp_path / "rows.bin")
    disk.make_rows_file(path, 64, 1000, chunk_rows=16)
    assert os.path.getsize(path) == 64_000
    cells = {"disk preadv, 16 in flight": disk.ceiling(path, 64, 1000, 4, 40),
             "np.memmap gather": disk.memmap_gather(path, 64, 1000, 2, 8, 10.0),
             "shmreplay iterate, prefetch WILLNEED": disk.fadvise_batches(path, 64, 1000, 32, 8)}
    assert [r["rows"] for r in cells.values()] == [40, 16, 32]
    report = {"results": {**cells, "seed row": {
        "capacity": 10, "item_bytes": 5, "GB": 0.0, "fill_s": 1.0, "fill_items_per_s": 10.0, "prefetch": 2,
        "method": "fadvise", "inserts_per_s": 420.0, "samples_per_s": 100.0, "max_inserts_per_s": 300.0,
        "max_samples_per_s": 2000.0, "file_removed": True}}}
    # the script as it runs (`python3 benchmarks/capacity.py`): its folder first
    # on sys.path, so its `from harness import ...` finds benchmarks/harness
    code = ("import json, sys, capacity\n"
            "report = json.load(sys.stdin)\n"
            "print(json.dumps([capacity.table(report), capacity.targets(report)]))\n")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(report), capture_output=True,
                         text=True, timeout=120, env=checkout_env(),
                         cwd=os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    assert out.returncode == 0, out.stderr
    text, lines = json.loads(out.stdout)
    assert "| np.memmap gather | not dropped |" in text and "learner flat out: 2,000 samples/s" in text
    assert len(lines) == 4 and lines[2].startswith("PASS seed row inserts") and lines[3].startswith("MISS")


def test_a_peer_without_its_venv_is_reported_with_the_reason_and_the_table_says_so(monkeypatch):
    """No peer venv is needed: the venv pythons point nowhere, and
    available() names the reason instead of raising; the table gives every
    peer a column (n/a where a peer has no multiprocess mode)."""
    from shmreplay.bench import peers, runner
    monkeypatch.setenv("SHMREPLAY_PEERS_PYTHON", "/nonexistent/peers/python")
    monkeypatch.setenv("SHMREPLAY_FLASHBAX_PYTHON", "/nonexistent/flashbax/python")
    status = peers.available()
    assert status["shmreplay"] is None
    for name in ("torchrl", "reverb", "flashbax"):
        assert "no python at /nonexistent/" in status[name]
    report = {"peer_status": {"torchrl": {"missing": status["torchrl"]},
                              "flashbax": {"versions": {"flashbax": "0"}}},
              "results": [
                  {"cell": "mp2", "peer": "shmreplay", "workload": "sac-mujoco", "batches_per_s": 900.0},
                  {"cell": "mp2", "peer": "flashbax", "workload": "sac-mujoco", "na": "no multi-process mode"},
              ]}
    text = runner.table(report)
    assert "| shmreplay | cpprb | torchrl | reverb | flashbax |" in text
    assert "| sac-mujoco | mp2 | batches_per_s | 900 |  | not run |  | n/a |" in text
    assert "torchrl: not run: no python at /nonexistent/peers/python" in text
    assert "n/a: flashbax: no multi-process mode" in text


def _nices(pid: int) -> set[int]:
    """The nice value of every thread of process ``pid`` (/proc/PID/task/*/stat)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            out.add(int(f.read().rsplit(")", 1)[1].split()[16]))
    return out


def test_the_capacity_daemon_keeps_its_table_across_restarts_and_runs_at_the_daemon_nice(tmp_path):
    """benchmarks/capacity.py's daemon (a shmreplay.Server): a file-backed
    table filled once is kept through a stop and served again under other prefetch
    settings, every thread of it at the deployed daemon's nice (set before
    it starts, so also the threads it made first).  The end is
    capacity.py's: a start that retains nothing adopts the table, drops
    it, and stops leaving nothing in /dev/shm (Server.stop checks)."""
    from benchmarks.harness import disk
    store = str(tmp_path / "tables")
    os.makedirs(store, mode=0o750)
    daemon = disk.BenchDaemon(store)
    want = -5 if os.geteuid() == 0 else os.getpriority(os.PRIO_PROCESS, 0)  # only root may lower it
    try:
        daemon.start(threads=2)
        assert _nices(daemon.server.pid) == {want}
        with daemon.connect() as c:
            c.create_table("cap", capacity=64, fields=disk.DQN.fields, storage_dir=store)
        assert disk.fill(daemon.socket, "cap", 40, chunk=16) >= 0
        daemon.stop()  # a clean stop keeps the table's segment for the next start (retain_tables)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"shmreplay.{daemon.instance}.t.cap.")]
        daemon.start(1, "fadvise")
        assert _nices(daemon.server.pid) == {want}
        with daemon.connect() as c:
            assert len(c.table("cap")) == 40
    finally:
        daemon.stop()
        daemon.start(0, retain=False)
        with daemon.connect() as c:
            for name in c.list_tables():
                c.drop_table(name)
        daemon.stop()
    assert not [n for n in os.listdir("/dev/shm") if daemon.instance in n]


def test_a_cells_daemon_runs_at_the_daemon_nice_whether_or_not_server_takes_preexec():
    """A cell's daemon (peers.Daemon) has every thread at the deployed
    daemon's nice through Server's ``preexec``.  A Server from before
    ``preexec`` (benchmarks/compare.py --before runs this harness on one)
    gets it through ``peers.niced``: a daemon started inside it, without
    ``preexec``, has every thread at that nice too, and the thread that
    started it is back at its own nice afterwards."""
    import shmreplay
    from shmreplay.bench import peers
    own = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's
    want = own + peers.DAEMON_NICE if os.geteuid() == 0 else own  # only root may lower it
    daemon = peers.Daemon()
    try:
        assert _nices(daemon.server.pid) == {want}
    finally:
        daemon.stop()
    with peers.niced(peers.DAEMON_NICE):
        server = shmreplay.Server(log_level="warning")
    try:
        assert os.getpriority(os.PRIO_PROCESS, 0) == own
        assert _nices(server.pid) == {want}
    finally:
        server.stop()


def _counting_actor(counter, seconds, start, out):
    from shmreplay.bench import peers

    def put(rows):
        with counter.get_lock():
            counter.value += 1
        time.sleep(0.005)
    peers.actor_loop(put, "sac-mujoco", 16, seconds, 0, start, out)


def test_mp_actors_insert_until_the_learners_last_batch_is_in():
    """The qmp cells hung: actors stopped on their own clock, a queue's
    learner began one last batch, and waited for items no one would insert.
    Here the learner's one call runs past the cell's seconds and then needs
    one more insert; the actors must still be running to make it."""
    import multiprocessing as mp

    from shmreplay.bench import peers
    ctx = mp.get_context("fork")
    counter, start, out = ctx.Value("q", 0), ctx.Event(), ctx.Queue()
    seconds = 0.2
    procs = [ctx.Process(target=_counting_actor, args=(counter, seconds, start, out)) for _ in range(2)]

    def learner_step():
        time.sleep(seconds + 0.5)  # past the cell's end: old actors had stopped by now
        seen, deadline = counter.value, time.monotonic() + 60
        while counter.value == seen:
            assert time.monotonic() < deadline, "the actors stopped before the learner's last batch"
            time.sleep(0.01)
    res = peers.run_mp(procs, start, out, seconds, learner_step, lambda: counter.value)
    assert all(not p.is_alive() for p in procs)
    assert res["batches_per_s"] > 0 and res["inserts_per_s"] > 0
