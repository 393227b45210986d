"""Issue 14, item 3: a table larger than the memory its processes may use.

A daemon, an actor and a learner run inside a memory cgroup limited to
512 MiB (v1 ``memory.limit_in_bytes``, else v2 ``memory.max``; skipped with
the reason when neither can be made), with a 2 GiB file-backed table.  Page
cache is charged to the cgroup, so this is a 512 MiB machine for them: the
actor fills the table completely, the learner drains it through ``sample``
(a queue delivers each item exactly once) and checks every row's bytes
against its id, and nobody is OOM-killed.  Their anonymous memory stays
bounded by the interpreter and a batch, not by the rows they streamed.

Every process joins the cgroup before it runs anything of ours: a shell
writes its own pid to ``cgroup.procs`` and execs the program.
"""

import json
import os
import subprocess
import sys
import threading

import pytest

from waiting import HANG_S

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "cgroup_client.py")
LIMIT = 512 << 20
ROW_WORDS = 32767           # obs: 262,136 bytes; with the 8-byte id an item is 256 KiB
CAPACITY = 8192             # 8,192 x 256 KiB = 2 GiB of rows, 4x the limit
BATCH = 32                  # 8 MiB a batch
TABLE_BYTES = CAPACITY * (ROW_WORDS + 1) * 8
ANON_BOUND = TABLE_BYTES // 16  # 128 MiB: an interpreter with numpy and numba, plus a few batches
# join the cgroup ("$0": its cgroup.procs), then become the program
JOIN = 'echo $$ > "$0" && exec "$@"'


def _own_cgroup(hierarchy: str) -> str | None:
    """This process's cgroup path in a v1 hierarchy ("memory") or v2 ("")."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (hierarchy and hierarchy in controllers.split(",")) or (not hierarchy and not controllers):
                return path
    return None


class MemoryCgroup:
    """A child of this process's own memory cgroup (nested: a test never
    moves anything out of the cgroup it was started in)."""

    def __init__(self, name: str):
        self.path = self.v = None
        reasons = []
        # v1, v2 beside it (hybrid), v2 alone (unified: mounted at the top)
        for version, mount in ((1, "/sys/fs/cgroup/memory"), (2, "/sys/fs/cgroup/unified"), (2, "/sys/fs/cgroup")):
            try:
                self._make(version, mount, name)
                return
            except OSError as exc:
                reasons.append(f"cgroup v{version} at {mount}: {exc}")
        pytest.skip("no writable memory cgroup: " + "; ".join(reasons))

    def _make(self, version: int, mount: str, name: str) -> None:
        own = _own_cgroup("memory" if version == 1 else "")
        if own is None or not os.path.isdir(mount):
            raise OSError(f"not mounted (this process is in no {'memory' if version == 1 else 'v2'} cgroup)")
        parent = os.path.join(mount, own.lstrip("/"))
        if version == 2:  # a child has memory.max only if its parent hands it the controller
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    raise OSError(f"memory is not in {os.path.join(parent, 'cgroup.subtree_control')}")
        path = os.path.join(parent, name)
        os.mkdir(path)  # PermissionError / EROFS: not root, or mounted read-only
        self.path, self.v, self.parent = path, version, parent
        try:
            if version == 1:
                self._write("memory.limit_in_bytes", LIMIT)
                if os.path.exists(self._p("memory.memsw.limit_in_bytes")):
                    self._write("memory.memsw.limit_in_bytes", LIMIT)  # no escape into swap
            else:
                self._write("memory.max", LIMIT)
                if os.path.exists(self._p("memory.swap.max")):
                    self._write("memory.swap.max", 0)
        except OSError:
            self.remove()
            raise

    def _p(self, f: str) -> str:
        return os.path.join(self.path, f)

    def _write(self, f: str, value) -> None:
        with open(self._p(f), "w") as fh:
            fh.write(str(value))

    def _read(self, f: str) -> str:
        with open(self._p(f)) as fh:
            return fh.read()

    def _keyed(self, f: str) -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in self._read(f).splitlines())}

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["/bin/sh", "-c", JOIN, self._p("cgroup.procs"), *cmd]

    def pids(self) -> set[int]:
        return {int(p) for p in self._read("cgroup.procs").split()}

    def limit(self) -> int:
        return int(self._read("memory.limit_in_bytes" if self.v == 1 else "memory.max"))

    def oom_kills(self) -> int:
        keyed = self._keyed("memory.oom_control" if self.v == 1 else "memory.events")
        return keyed.get("oom_kill", 0)

    def peak(self) -> int | None:
        f = "memory.max_usage_in_bytes" if self.v == 1 else "memory.peak"
        return int(self._read(f)) if os.path.exists(self._p(f)) else None

    def failcnt(self) -> int:
        return int(self._read("memory.failcnt")) if self.v == 1 else self._keyed("memory.events")["max"]

    def usage(self) -> dict[str, int]:
        """anon, page cache, dirty and under-writeback bytes now."""
        s = self._keyed("memory.stat")
        if self.v == 1:
            return {"anon": s["total_rss"], "cache": s["total_cache"], "dirty": s["total_dirty"],
                    "writeback": s["total_writeback"]}
        return {"anon": s["anon"], "cache": s["file"], "dirty": s["file_dirty"],
                "writeback": s["file_writeback"]}

    def remove(self) -> None:
        """Hand back what is left in it (only after a failure: the test ends
        every process it started) to the parent cgroup, then remove it."""
        if self.path is None or not os.path.isdir(self.path):
            return
        for pid in self.pids():
            try:
                with open(os.path.join(self.parent, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except ProcessLookupError:
                pass
        os.rmdir(self.path)


@pytest.fixture
def memcg():
    cg = MemoryCgroup(f"shmreplay-test{os.getpid()}")
    yield cg
    cg.remove()
    assert not os.path.exists(cg.path)


class Watch(threading.Thread):
    """Peaks of the cgroup's usage and of every member's RssAnon, polled."""

    def __init__(self, cg: MemoryCgroup):
        super().__init__(daemon=True)
        self.cg, self.stop = cg, threading.Event()
        self.usage: dict[str, int] = {}
        self.anon: dict[int, int] = {}

    def run(self) -> None:
        while True:
            for k, v in self.cg.usage().items():
                self.usage[k] = max(v, self.usage.get(k, 0))
            for pid in self.cg.pids():
                a = rss_anon(pid)
                if a is not None:
                    self.anon[pid] = max(a, self.anon.get(pid, 0))
            if self.stop.wait(0.05):
                return


def rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_client(cg: MemoryCgroup, *args) -> dict:
    run = subprocess.run(cg.wrap([sys.executable, CLIENT, *map(str, args)]), capture_output=True,
                         text=True, timeout=4 * HANG_S)
    # a SIGKILL (the OOM killer's) is -9 here, and its oom_kill count below
    assert run.returncode == 0, (f"{args[0]} exited with {run.returncode} (oom_kill "
                                 f"{cg.oom_kills()}):\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_2_gib_file_backed_table_is_filled_and_checked_row_by_row_in_512_mib(memcg, start_daemon,
                                                                              tmp_path):
    assert memcg.limit() == LIMIT
    store = tmp_path / "tables"
    d = start_daemon(storage_dir=str(store),
                     command=memcg.wrap([sys.executable, "-m", "shmreplay.server.daemon"]))
    assert memcg.pids() == {d.pid}, "the daemon runs in the cgroup, and nothing else yet"
    watch = Watch(memcg)
    watch.start()
    try:
        filled = run_client(memcg, "actor", d.socket, "big", CAPACITY, ROW_WORDS, BATCH)
        rows_file = store / f"shmreplay.{d.instance}.r.big"
        assert filled["file_backed"] and os.path.getsize(rows_file) >= TABLE_BYTES
        assert filled["size"] == CAPACITY, filled  # full: every slot holds a row
        drained = run_client(memcg, "learner", d.socket, "big", CAPACITY, BATCH)
    finally:
        watch.stop.set()
        watch.join()
    # every item delivered exactly once, and every byte of it what its id says
    assert drained["n_bad"] == 0, f"rows not what their id says: {drained['bad']}"
    assert drained["sampled"] == CAPACITY and drained["once"] == CAPACITY, drained
    assert drained["left"] == 0
    # nobody was OOM-killed; reclaim (failcnt) is expected, an OOM kill is not
    assert memcg.oom_kills() == 0 and d.proc.poll() is None
    # and the limit really bound them: 2 GiB of page cache went through
    # 512 MiB, so the kernel had to reclaim it as it went
    peak = memcg.peak()
    assert peak is None or 3 * LIMIT // 4 < peak <= LIMIT, peak
    # anonymous memory is bounded by the interpreter, metadata and a batch,
    # not by the 2 GiB of rows that went through each process
    anon = {"actor": filled["rss_anon_peak"], "learner": drained["rss_anon_peak"],
            "daemon": watch.anon.get(d.pid, 0)}
    assert 0 < anon["daemon"] and all(a < ANON_BOUND for a in anon.values()), anon
    assert watch.usage["anon"] < LIMIT // 2, watch.usage
    print(f"\ncgroup v{memcg.v}: peak {peak and peak >> 20} MiB, failcnt {memcg.failcnt()}, "
          f"max {({k: v >> 20 for k, v in watch.usage.items()})} MiB; "
          f"RssAnon peaks {({k: v >> 20 for k, v in anon.items()})} MiB")
    with d.connect() as c:
        c.drop_table("big")
    assert not os.path.exists(rows_file)
    code = d.stop(timeout=120)  # a hang guard: writeback of 2 GiB through 512 MiB is slow on a loaded box
    assert code == 0, d.hang_dump or d.log()[-4000:]
    assert memcg.pids() == set()
