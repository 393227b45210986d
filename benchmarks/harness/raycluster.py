"""A two-node Ray cluster on 127.0.0.1, for tests/test_ray.py and
benchmarks/ray_ingest.py: a head node labelled ``replay_node`` and a second
node labelled ``remote_node`` (so producers can be placed on the "remote"
one), each started with ``ray start --block`` in a session of its own, so
every process of a node belongs to a process this object owns and stops
with it.

Ray's token authentication is on (``token_auth``): whatever
``--node-ip-address`` says, Ray 2.60's GCS and raylets listen on every
interface, so without a token anyone who reaches this box could run code
on the cluster as its user while it runs.  The token is drawn once per
process and handed on in the environment (``RAY_AUTH_TOKEN``), so no
``~/.ray/auth_token`` is made.  Ray reads the mode when it is imported: a
driver calls ``token_auth`` before ``import ray``.  Who calls it: one
driver process, one thread.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def token_auth() -> None:
    """Turn Ray's token authentication on for this process and every
    process it starts (the environment), with a token drawn here unless
    one is set; before ``import ray`` (RuntimeError after it, unless it
    was already on)."""
    if os.environ.get("RAY_AUTH_MODE") == "token" and os.environ.get("RAY_AUTH_TOKEN"):
        return
    if "ray" in sys.modules:
        raise RuntimeError("Ray was imported before its token authentication was set: call "
                           "raycluster.token_auth() (benchmarks/harness) before 'import ray'")
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
START_S = 120.0  # a hang guard for a node to come up on a loaded box
REAP_S = 30.0    # ... and for what is left of one to go after SIGKILL


class LocalCluster:
    def __init__(self, remote_cpus: int, object_store_bytes: int, pythonpath: str | None = None,
                 remote_nodes: int = 1):
        """``pythonpath``: a folder the nodes' workers import from (a test's
        helpers).  ``remote_nodes``: nodes besides the head, each with
        ``remote_cpus`` (labelled ``remote_node``, and ``remote_node_<k>``
        for the k-th, k from 1)."""
        self.remote_cpus, self.store, self.pythonpath = remote_cpus, object_store_bytes, pythonpath
        self.remote_nodes = remote_nodes
        self.nodes: list[subprocess.Popen] = []
        self.sessions: list[int] = []  # each node's session id (its ``ray start``'s pid)
        self.temp = self.address = None
        self._saved = None

    def start(self) -> str:
        """Start both nodes; returns the head's address (host:port)."""
        token_auth()
        self.temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.nodes.append(self._node("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                                     "--resources=" + json.dumps({"replay_node": 1})))
        deadline = time.monotonic() + START_S
        while not listening(port):
            if self.nodes[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head node did not come up (exit code {self.nodes[0].poll()})")
            time.sleep(0.1)
        if self.remote_nodes == 1:
            self._remote(1)
        return self.address

    def _remote(self, k: int) -> None:
        # nodes on one address clash on their agents' fixed default ports
        ports = [f"--{flag}={_free_port()}" for flag in AGENT_PORTS] if self.remote_nodes > 1 else []
        self.nodes.append(self._node(f"--address={self.address}", f"--num-cpus={self.remote_cpus}", *ports,
                                     "--resources=" + json.dumps({"remote_node": self.remote_cpus,
                                                                  f"remote_node_{k}": 1})))

    def connect(self, **init) -> str:
        """``ray.init`` this process as the cluster's driver, wait for the
        second node; returns the head node's id (where the replay lives)."""
        import ray
        self._saved = {k: os.environ.get(k) for k in ENV}
        os.environ.update(ENV)
        ray.init(address=self.address, logging_level="ERROR", log_to_driver=False, **init)
        if self.remote_nodes > 1:
            # one at a time: raylets starting together in one session folder
            # race for the names of their sockets (one dies, "bind: Address
            # already in use")
            for k in range(1, self.remote_nodes + 1):
                self._remote(k)
                deadline = time.monotonic() + START_S
                while not ray.cluster_resources().get(f"remote_node_{k}"):
                    if self.nodes[-1].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"Ray node {k} did not join (exit code {self.nodes[-1].poll()})")
                    time.sleep(0.1)
        deadline = time.monotonic() + START_S
        while ray.cluster_resources().get("remote_node") != self.remote_cpus * self.remote_nodes:
            if time.monotonic() > deadline:
                raise RuntimeError("the other Ray nodes did not join")
            time.sleep(0.1)
        return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "replay_node" in n["Resources"])

    def node_ids(self) -> list[str]:
        """The alive nodes' ids: the head's first, then the k-th remote node's."""
        import ray
        alive = [n for n in ray.nodes() if n["Alive"]]
        head = [n["NodeID"] for n in alive if "replay_node" in n["Resources"]]
        rest = sorted((next(int(r.rsplit("_", 1)[1]) for r in n["Resources"] if r.startswith("remote_node_")),
                       n["NodeID"]) for n in alive if "remote_node" in n["Resources"])
        return head + [node for _, node in rest]

    def lose_node(self, k: int) -> None:
        """Stop the k-th remote node for good (every process of its session),
        as a box that went away: what ran there dies with it."""
        _stop(self.nodes[k])
        deadline = time.monotonic() + REAP_S
        while _session(self.sessions[k]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {k}'s processes outlived SIGKILL for {REAP_S} s")
            for pid in _session(self.sessions[k]):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def stop(self) -> None:
        """Disconnect the driver, stop every node, remove the temp folder."""
        try:
            import ray
            if ray.is_initialized():
                ray.shutdown()
        finally:
            for p in reversed(self.nodes):
                _stop(p)
            self.nodes = []
            _reap(self.sessions)
            if self.temp:
                shutil.rmtree(self.temp, ignore_errors=True)
            for k, v in (self._saved or {}).items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def leftovers(self) -> list[int]:
        """Live processes of the nodes' sessions (none once ``stop`` returned)."""
        return _alive(self.sessions)

    def _node(self, *args) -> subprocess.Popen:
        env = dict(os.environ, **ENV)
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.pythonpath, os.environ.get("PYTHONPATH")) if p)
        p = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                              "--node-ip-address=127.0.0.1", f"--object-store-memory={self.store}",
                              "--disable-usage-stats", f"--temp-dir={self.temp}", *args],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        self.sessions.append(p.pid)
        return p


AGENT_PORTS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
               "runtime-env-agent-port", "node-manager-port", "object-manager-port")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _stop(p: subprocess.Popen) -> None:
    """SIGTERM the node's session, then SIGKILL what is left of it: a head
    node's graceful stop waits ~30 s for its GCS, and nothing of it is
    needed any more (the driver disconnected first)."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(2)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _session(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: a node's ``ray
    start`` and everything it started, workers included, which make
    process groups of their own (so ``killpg`` misses them) but keep the
    session.  A worker is meant to exit when its raylet dies; one that
    did not (a threaded actor, seen once) would outlive the cluster."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, _, _, session = stat[stat.rindex(")") + 2:].split()[:4]
        if int(session) == sid and state != "Z":
            out.append(int(d))
    return out


def _alive(sessions: list[int]) -> list[int]:
    return [pid for sid in sessions for pid in _session(sid)]


def _reap(sessions: list[int]) -> None:
    """SIGKILL whatever of the nodes' sessions is still alive, and wait
    (at most REAP_S) until it is gone."""
    deadline = time.monotonic() + REAP_S
    while True:
        left = _alive(sessions)
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray processes outlived SIGKILL for {REAP_S} s: {left}")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
