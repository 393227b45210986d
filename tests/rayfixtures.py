"""What the Ray test modules share: the local two-node cluster (one per
module, benchmarks/harness/raycluster.py: both nodes on 127.0.0.1, the head
labelled ``replay_node``, the other ``remote_node``), and the window in
which the counts of chunks an ingest holds (coalesce.py) prove something.

Import the fixture into a module (``from rayfixtures import cluster``);
pytest then starts one cluster for that module and stops it at its end.
Every such module carries ``pytestmark = pytest.mark.xdist_group("ray")``:
one Ray at a time on the box."""

import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from daemons import CHECKOUT
from benchmarks.harness.raycluster import START_S, LocalCluster, listening
from waiting import processes, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
# where Ray keeps state when not told otherwise: a run of the suite makes
# neither (its nodes use a temp folder of their own, token auth is off)
RAY_DEFAULTS = ("/tmp/ray", os.path.expanduser("~/.ray"))
# the largest hold_s start_ingest accepts (0..10 s): the longest a
# test can keep the ingest's own thread from inserting what it holds
HOLD_MAX = 10.0


@pytest.fixture(scope="module")
def cluster():
    """The head node's id; workers import the test helpers from this
    folder (rayproducer.py) and shmreplay from this checkout (not an
    installed copy: the code under test, also for clients/apex_dqn.py's
    actors)."""
    absent = [p for p in RAY_DEFAULTS if not os.path.exists(p)]
    c = LocalCluster(remote_cpus=3, object_store_bytes=100_000_000,
                     pythonpath=os.pathsep.join([HERE, CHECKOUT]))
    try:
        c.start()
        yield c.connect()
    finally:
        c.stop()
    # every process of both nodes is gone, workers too (their own process
    # groups: a paused threaded Producer once outlived the nodes' killpg)
    assert not c.leftovers()
    assert not os.path.exists(c.temp), f"the nodes' session files are left in {c.temp}"
    assert not [p for p in absent if os.path.exists(p)], "Ray made state of its own outside the run"


@pytest.fixture(scope="module")
def cluster3():
    """A three-node cluster (the head, ``replay_node``; two more,
    ``remote_node_1`` and ``remote_node_2``), all on 127.0.0.1, for the
    sharded tables' modules: the ``LocalCluster`` itself (``node_ids``,
    ``lose_node``), this process its driver."""
    absent = [p for p in RAY_DEFAULTS if not os.path.exists(p)]
    c = LocalCluster(remote_cpus=1, object_store_bytes=100_000_000,
                     pythonpath=os.pathsep.join([HERE, CHECKOUT]), remote_nodes=2)
    try:
        c.start()
        c.connect()
        yield c
    finally:
        c.stop()
    assert not c.leftovers()
    assert not os.path.exists(c.temp), f"the nodes' session files are left in {c.temp}"
    assert not [p for p in absent if os.path.exists(p)], "Ray made state of its own outside the run"


def before_the_ingest_thread(attempt, tries: int = 3):
    """What ``attempt(k)`` (k = 0, 1, ...) saw, from a run in which the
    ingest's thread could not yet have inserted the chunks it held.

    ``attempt`` starts an ingest with ``hold_s=HOLD_MAX`` (and a table
    ``k`` of its own), waits until it serves, notes ``time.monotonic()``,
    sends its chunks, reads the ingest's counts, and returns ``(seconds
    since that note, what it read)``.  The thread inserts held chunks no
    sooner than ``hold_s`` after the first came (``Ingest._release_held``),
    which was after the note, and the counts were read before the seconds
    were taken: if fewer than HOLD_MAX, only the calls moved them.  A run
    on a machine stalled for that long proves nothing and runs again (no
    assertion waits on the clock: this only tells a valid observation)."""
    for k in range(tries):
        seconds, got = attempt(k)
        if seconds < HOLD_MAX:
            return got
    pytest.fail(f"{tries} runs each took {HOLD_MAX} s or more: the machine stalled throughout")


class MemberCluster:
    """A one-node Ray cluster whose every process runs as a real user
    (``ident``: people.py's (uid, gid, groups)), the way docs/reliability.md
    section 13 recommends running one next to a daemon: as a user that is
    only a member of the daemon's group.  Root is always the daemon's
    admin, so a cluster the tests start as root could show nothing.

    Ray's token authentication is on (``RAY_AUTH_MODE=token``, a token
    drawn here and given in the environment, so no token file is made):
    Ray's GCS listens on every interface whatever ``--node-ip-address``
    says.  The interpreter may live under a directory other users cannot
    enter (/root, 0700, here): the head then starts in a mount namespace
    of its own where that directory is a tmpfs holding only the way to the
    interpreter (``_mounts``), as the systemd box does (systemdbox.py);
    the jobs' drivers join that namespace (``nsenter``).

    The cluster's folder (``temp``, the user's) sits in one of root's
    (``base``, 0711) that holds what root writes (logs, a mount point):
    root opens nothing in a folder the cluster's code can write.

    Who calls it: one test, one thread, root only.  ``stop`` ends every
    process of the cluster and removes both folders."""

    def __init__(self, ident, pythonpath: list[str]):
        self.uid, self.gid, self.groups = ident
        self.pythonpath = pythonpath
        self.head = self.base = self.temp = self.address = None
        self.env = {}

    def start(self) -> str:
        self.base = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
        os.chmod(self.base, 0o711)
        self.temp = os.path.join(self.base, "r")
        os.mkdir(self.temp, 0o700)
        os.mkdir(f"{self.base}/code", 0o755)
        for i in range(len(self.pythonpath)):
            os.mkdir(f"{self.base}/code/{i}", 0o755)
        os.chown(self.temp, self.uid, self.gid)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.temp,
                    "PYTHONPATH": os.pathsep.join(map(self.inside, self.pythonpath)),
                    "NUMBA_CACHE_DIR": f"{self.temp}/numba",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": self.address}
        cmd = [*self._as_member(), sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
               "--object-store-memory=80000000", "--disable-usage-stats", f"--temp-dir={self.temp}"]
        script = "set -e\n" + self._mounts() + "exec " + " ".join(shlex.quote(a) for a in cmd)
        with open(f"{self.base}/head.log", "wb") as log:
            self.head = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                                          script], env=self.env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + START_S
        while not listening(port):
            if self.head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not come up (exit code {self.head.poll()}): "
                                   f"{self.log('head')[-2000:]}")
            time.sleep(0.1)
        return self.address

    def log(self, name: str) -> str:
        """What the head (``head``) or a job (its ``name``) wrote to stderr."""
        try:
            with open(f"{self.base}/{name}.log", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def job(self, name: str, *argv):
        """A driver process of a new job, as the cluster's user, in the
        head's mount namespace: ``python argv...``, stdin and stdout piped
        (text), stderr to ``log(name)``."""
        with open(f"{self.base}/{name}.log", "wb") as log:
            return subprocess.Popen(["nsenter", f"--target={self.head.pid}", "--mount", "--", *self._as_member(),
                                     sys.executable, *map(self.inside, argv)], env=self.env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)

    def stop(self) -> None:
        """End every process of the head's session (its workers too) and
        of the user, then remove the folders."""
        if self.head is not None:
            sid = self.head.pid
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in self.leftovers():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                if sig == signal.SIGTERM:
                    try:
                        self.head.wait(2)
                    except subprocess.TimeoutExpired:
                        pass
            self.head.wait()
            wait_for(lambda: not self.leftovers(), f"the Ray head's processes (session {sid}) to go")
        if self.base:
            shutil.rmtree(self.base, ignore_errors=True)  # never follows a link the cluster made

    def leftovers(self) -> list[int]:
        """Live processes of the head's session, and any other of the user's."""
        mine = set(_session_members(self.head.pid)) if self.head else set()
        for pid, _ in processes():
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if uid == self.uid:
                mine.add(pid)
        return sorted(mine)

    def _as_member(self) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups",
                "--inh-caps=-all", "--"]

    def inside(self, path: str) -> str:
        """Where ``path`` (a ``pythonpath`` folder or a file under one) is
        seen in the head's mount namespace: each folder is bound under
        ``base/code/<i>``, so a checkout inside a folder others cannot
        enter (``mktemp -d`` makes 0700 ones) is still the cluster's to
        import; anything else (a relative argument too) is left as it is."""
        if not os.path.isabs(path):  # an argument, not a path
            return path
        for i, folder in enumerate(self.pythonpath):
            rel = os.path.relpath(os.path.realpath(path), os.path.realpath(folder))
            if rel == "." or not rel.startswith(".."):
                return os.path.normpath(f"{self.base}/code/{i}/{rel}")
        return path

    def _mounts(self) -> str:
        """Shell lines that, in the head's mount namespace, bind each
        ``pythonpath`` folder under ``base/code`` (``inside``) and let the
        user reach the interpreter: the outermost directory above it that
        others cannot enter becomes a 0711 tmpfs holding only the way down."""
        binds = "".join(f"mount --bind {shlex.quote(os.path.realpath(folder))} "
                        f"{shlex.quote(f'{self.base}/code/{i}')}\n" for i, folder in enumerate(self.pythonpath))
        return binds + self._interpreter_mounts()

    def _interpreter_mounts(self) -> str:
        prefix = os.path.realpath(sys.base_prefix)
        parts = prefix.strip("/").split("/")
        for i in range(1, len(parts)):
            closed = "/" + "/".join(parts[:i])
            if not os.stat(closed).st_mode & stat.S_IXOTH:
                closed, child = shlex.quote(closed), shlex.quote(f"{closed}/{parts[i]}")
                hold = shlex.quote(f"{self.base}/interpreter")
                return (f"mkdir {hold}\nmount --bind {child} {hold}\n"
                        f"mount -t tmpfs -o mode=0711 tmpfs {closed}\nmkdir {child}\nmount --move {hold} {child}\n")
        return ""


def member_cluster_unusable(*folders: str) -> str | None:
    """Why a MemberCluster cannot run here, or None: it needs root, the
    tools, and ``folders`` (the code its processes import) readable by
    others (the folders above them may be closed, as may the interpreter's:
    ``_mounts`` binds them where the cluster's user can reach them)."""
    if os.geteuid() != 0:
        return "needs root (users, a mount namespace)"
    missing = [t for t in ("unshare", "nsenter", "setpriv") if not shutil.which(t)]
    if missing:
        return f"needs {', '.join(missing)}"
    for folder in folders:
        if os.stat(folder).st_mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
            return f"{folder} is closed to other users: the cluster's user could not import it"
    return None


def _session_members(sid: int) -> list[int]:
    return [pid for pid, f in processes() if int(f[3]) == sid and f[0] != "Z"]
