"""A producer actor and a parameter reader for the Ray tests, in a module
of its own so the Ray workers (started with this folder on PYTHONPATH)
can import them."""

import threading

import numpy as np
import ray

import shmreplay.ray as sray
from shmreplay.ray.producers import new_key

FIELDS = {"id": ("int64", ()), "obs": ("float32", (8,))}
# producers' keys for tests that call the ingest directly (put, sync): a
# producer is known by a secret key of 128 random bits (producers.py), never a name
P, GONE, LIVE, BACK, QUIET = (new_key() for _ in range(5))


def rows(ids) -> dict:
    """Rows whose obs is a function of their id: a torn row shows."""
    ids = np.asarray(ids, np.int64)
    return {"id": ids, "obs": (ids[:, None] % 1000 + np.arange(8)).astype(np.float32)}


@ray.remote(resources={"remote_node": 1}, num_cpus=0, max_concurrency=2)
class Producer:
    def __init__(self, ingest, chunk, in_flight, hold=8):
        self.w = sray.RemoteWriter(ingest, chunk=chunk, in_flight=in_flight, hold=hold)
        self.most_unconfirmed = 0
        self.paused, self.go = threading.Event(), threading.Event()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def write(self, ids, one_by_one: bool, pause_at: int | None = None, flush_at_pause: bool = True) -> int:
        """Write ``ids``; with ``pause_at``, after that many rows (flushed
        if ``flush_at_pause``, else some still unconfirmed) wait for
        ``resume`` (the test breaks something meanwhile)."""
        data = rows(ids)
        if one_by_one:
            for i in range(len(ids)):
                if i == pause_at:
                    if flush_at_pause:
                        self.w.flush()
                    self.paused.set()
                    self.go.wait(300)
                self.w.insert(id=data["id"][i], obs=data["obs"][i])
                self.most_unconfirmed = max(self.most_unconfirmed, self.w.unconfirmed)
        else:
            self.w.insert_batch(data)
        self.w.flush()
        return self.w.confirmed

    def progress(self) -> tuple:
        return self.w.sent, self.w.confirmed, self.most_unconfirmed, self.w.unconfirmed

    def resent(self) -> int:
        return self.w.resent

    def is_paused(self) -> bool:
        return self.paused.is_set()

    def resume(self) -> int:
        self.go.set()
        return self.w.resent


@ray.remote(resources={"remote_node": 1}, num_cpus=0)
def nstep_episodes(ingest, episodes, n, gamma, fields=None) -> int:
    """Write ``episodes`` ([(steps, end)], steps as (obs, action, reward,
    next_obs)) through a RemoteNStepWriter, on the remote node."""
    w = sray.RemoteNStepWriter(ingest, n=n, gamma=gamma, fields=fields, chunk=8)
    buf = np.zeros(2, np.float32)  # one observation buffer, reused as an actor's loop does
    for steps, end in episodes:
        for i, (o, a, r, o2) in enumerate(steps):
            last = i == len(steps) - 1
            buf[:] = o
            w.append(obs=buf, action=a, reward=r, next_obs=o2, terminated=last and end == "terminated",
                     truncated=last and end == "truncated")
    w.close()
    return w.writer.confirmed


@ray.remote(resources={"remote_node": 1}, num_cpus=0)
def sequence_steps(ingest, episodes, length, period) -> int:
    w = sray.RemoteSequenceWriter(ingest, length=length, period=period, chunk=4)
    for steps in episodes:
        for x, h in steps:
            w.append(x=x, h=h)
        w.end_episode()
    w.close()
    return w.writer.confirmed


@ray.remote(resources={"remote_node": 1}, num_cpus=0)
def read_parameters(relay, newer_than):
    """What an actor on the other node (as on another machine: it cannot
    map the board) gets from a parameter relay, and that node's id."""
    return ray.get(relay.latest.remote(newer_than)), ray.get_runtime_context().get_node_id()


@ray.remote(resources={"remote_node": 1}, num_cpus=0)
def claim(ingest, key, seqs) -> dict:
    """Another party on the cluster that holds a producer's ``key`` (or
    what it takes for it) sends an empty chunk under each of ``seqs`` and
    has them flushed by a call of its own (its own key), so that the
    ingest owes ``key`` those sequence numbers as vouched for, at its next
    answer.  Returns the ingest's stats after."""
    empty = rows(np.arange(0))
    for s in seqs:
        ray.get(ingest.put.remote(empty, [None, key, s, False, None]))
    ray.get(ingest.sync.remote(new_key()))
    return ray.get(ingest.stats.remote())


def restarted(ingest, pid: int) -> bool:
    """Whether a new incarnation of the ingest (not process ``pid``) answers."""
    try:
        return ray.get(ingest.pid.remote(), timeout=10) != pid
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
