"""A shard's node: its daemon, and the ingests that feed its tables.

``start_shards`` puts one ``ShardHost`` actor on each chosen Ray node
(``NodeAffinitySchedulingStrategy(soft=False)``).  A host either starts a
private daemon there (a ``shmreplay.Server``: its own instance, a 0700
socket folder, tables this user's alone) and starts it again when it dies
(``Server.restart``: the new daemon adopts the tables the dead one left in
/dev/shm, so their items come back), or, given ``sockets=``, attaches to a
daemon the operator runs as a service (systemd restarts that one).  Either
way the host owns the ingest actor of each of the node's tables
(``ingest``): writers on other nodes send their chunks there, and the
ingests live as long as the host, not as long as whichever learner made
the table.

A daemon started here keeps its tables in /dev/shm whenever it stops
(``retain_tables``): only ``stop_shards``, the operator's own stop, drops
them first.  It is the host's child (``PR_SET_PDEATHSIG``): a host that
dies (killed by another job, its worker crashed) stops its daemon, which
leaves the shard's items behind for the next daemon of its instance, and
the sharded table serves on with the other shards (``shardtable.py``).
``start_shards(instance=...)`` names each daemon's instance after it and
the shard's place, so starting the shards again with the same name adopts
what a dead host's daemon left (its socket is then another).  A host is
never restarted by Ray (``max_restarts=0``): that new one would start an
empty daemon under an instance of its own.  A node lost for good takes
its shard's items with it.

Who calls it: ``start_shards`` / ``attach_shards`` / ``stop_shards`` a
driver, one thread.  The host's methods run one at a time (a Ray actor
without concurrency); its watch thread only restarts the daemon.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..client.private_daemon import Server
from ..errors import ReplayError
from .ingest import start_ingest

# A daemon that dies more often than this within RESTART_WINDOW_S is left
# dead (a crash loop: its log says why), not restarted for ever.
RESTARTS_MAX = 5
RESTART_WINDOW_S = 60.0
HOST_START_S = 180.0  # the first daemon on a node compiles the kernels


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard: the Ray node it lives on, its daemon's socket there, the
    host actor that owns its ingests (and its daemon, when started here)."""

    node: str
    socket: str
    host: object  # a ShardHost actor handle


class ShardHost:
    """One node's shard daemon (started here, or attached to) and its ingests."""

    def __init__(self, socket: str | None, server_options: dict, auto_restart: bool):
        self.ingests: dict = {}
        self.server = None
        self.restarts: list[float] = []
        self.gave_up: str | None = None
        self.auto_restart = auto_restart
        self._lock = threading.Lock()
        self._stopping = False
        if socket is not None:
            self.socket = socket
            return
        started = threading.Event()
        failed: list[BaseException] = []

        def run():  # the daemon is this thread's child (PDEATHSIG): the thread lives as long as the actor
            try:
                self.server = Server(**server_options)
            except BaseException as exc:
                failed.append(exc)
                return
            finally:
                started.set()
            self._watch()

        threading.Thread(target=run, name="shard-daemon", daemon=True).start()
        if not started.wait(HOST_START_S) or failed:
            raise ReplayError(f"the shard daemon on this node did not start: {failed[0] if failed else 'timed out'}")
        self.socket = self.server.socket

    def _watch(self) -> None:
        """Start the daemon again when it dies, unless stopping, told not
        to (``auto_restart`` off: ``restart_daemon`` does it, polled here at
        10 Hz), or it died RESTARTS_MAX times within RESTART_WINDOW_S."""
        while True:
            proc = self.server.proc
            if proc is None:
                return
            proc.wait()
            while True:
                with self._lock:
                    if self._stopping or self.gave_up:
                        return
                    if self.server.proc is not proc:  # restarted by restart_daemon
                        break
                    if self.auto_restart:
                        self._restart_locked()
                        break
                time.sleep(0.1)

    def _restart_locked(self) -> None:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self.restarts) > RESTARTS_MAX:
            self.gave_up = (f"the daemon died {len(self.restarts)} times within {RESTART_WINDOW_S:g} s; "
                            f"left stopped. Its log ends:\n{self.server.log_tail()}")
            return
        try:
            self.server.restart()
        except ReplayError as exc:
            self.gave_up = f"the daemon did not start again: {exc}"

    def where(self) -> dict:
        """This node, the socket, the daemon's pid (None: not started here),
        whether it runs, its restarts so far, and why it was left dead."""
        proc = self.server.proc if self.server is not None else None
        return {"node": ray.get_runtime_context().get_node_id(), "socket": self.socket,
                "pid": proc.pid if proc is not None else None,
                "instance": self.server.instance if self.server is not None else None,
                "running": proc is not None and proc.poll() is None,
                "restarts": len(self.restarts), "gave_up": self.gave_up}

    def set_auto_restart(self, on: bool) -> None:
        """Whether a daemon that dies is started again by the watch thread."""
        with self._lock:
            self.auto_restart = bool(on)

    def restart_daemon(self) -> dict:
        """Start a daemon that died again now (the tests' way when
        ``auto_restart`` is off); returns ``where()``."""
        if self.server is None:
            raise ReplayError("this shard's daemon is a service of the node's own: restart it there")
        with self._lock:
            if self.server.proc is not None and self.server.proc.poll() is not None:
                self._restart_locked()
        return self.where()

    def ingest(self, table: str, **options):
        """The ingest of ``table`` on this node (started at the first ask;
        the same one after)."""
        if table not in self.ingests:
            self.ingests[table] = start_ingest(self.socket, table, **options)
        return self.ingests[table]

    def forget(self, table: str) -> None:
        """Stop the ingest of a table that was dropped."""
        handle = self.ingests.pop(table, None)
        if handle is not None:
            ray.kill(handle)

    def stop(self) -> None:
        """Stop every ingest, and the daemon if it was started here (its
        tables go with it; a dead one's too)."""
        for table in list(self.ingests):
            self.forget(table)
        with self._lock:
            self._stopping = True
            if self.server is None:
                return
            if self.server.proc is not None and self.server.proc.poll() is not None:
                # a daemon killed and not started again left its tables: a
                # new one adopts them, so they go the way a running one's do
                try:
                    self.server.restart()
                except ReplayError:
                    pass  # its log says why; ``shmreplay cleanup --instance`` removes them
            try:  # the daemon keeps its tables at shutdown (retain_tables): drop them first
                with self.server.connect(timeout=10.0) as admin:
                    for name in admin.list_tables():
                        admin.drop_table(name)
            except ReplayError:
                pass  # a daemon that does not answer leaves them to ``shmreplay cleanup``
        self.server.stop(check=False)


def start_shards(nodes: list[str] | None = None, auto_restart: bool = True, instance: str | None = None,
                 **server_options) -> list[Shard]:
    """A shard daemon for each of ``nodes`` (Ray node ids, a node may come
    more than once; default each alive node), each owned by a ``ShardHost``
    pinned there.  ``server_options``: ``shmreplay.Server``'s (``group=``,
    daemon keys such as ``log_level``); ``tables=`` is refused (make them
    with ``ShardedTable.create``).  ``auto_restart``: a daemon that dies is
    started again (off: ``ShardHost.restart_daemon`` does it).
    ``instance``: the daemons' instances are ``<instance>s<k>`` (k: the
    place in ``nodes``), so a second ``start_shards`` with the same name
    adopts the tables a dead host's daemon left (default: an instance of
    each Server's own).  Returns the shards, in the order of ``nodes``."""
    if "tables" in server_options:
        raise ReplayError("start_shards makes no tables: use ShardedTable.create on the shards it returns")
    nodes = list(nodes) if nodes is not None else [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    options = [{**server_options, "retain_tables": True,
                **({"instance": f"{instance}s{k}"} if instance is not None else {})} for k in range(len(nodes))]
    return _hosts([(node, None) for node in nodes], options, auto_restart)


def node_alive(node: str) -> bool:
    """Whether Ray counts the node ``node`` alive (a shard's node lost for
    good is not)."""
    return any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())


def attach_shards(sockets) -> list[Shard]:
    """Shards on daemons the operator runs (a systemd service on each box):
    ``sockets``, (Ray node id, that daemon's socket path there) pairs, or a
    dict of them."""
    places = list(sockets.items()) if isinstance(sockets, dict) else list(sockets)
    return _hosts(places, [{}] * len(places), False)


def _hosts(places: list, options: list, auto_restart: bool) -> list[Shard]:
    if not places:
        raise ReplayError("no nodes to put shards on")
    handles = [ray.remote(ShardHost).options(
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
            sock, opts, auto_restart) for (node, sock), opts in zip(places, options)]
    try:
        where = ray.get([h.where.remote() for h in handles], timeout=HOST_START_S)
    except BaseException:
        for h in handles:
            ray.kill(h)
        raise
    return [Shard(node, w["socket"], h) for (node, _), w, h in zip(places, where, handles)]


def stop_shards(shards: list[Shard], timeout: float = 60.0) -> None:
    """Stop each shard's host (its ingests; the daemon it started, and so
    that shard's tables); a shard whose node is gone is skipped."""
    refs = [s.host.stop.remote() for s in shards]
    for s, ref in zip(shards, refs):
        try:
            ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # its node (and daemon) is gone already, or it hangs: killed below
        ray.kill(s.host)
