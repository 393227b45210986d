"""apex_dqn.py's Ray side (``--ray ADDRESS``, ``--shards N``): actors as Ray
actors anywhere in the cluster, and with ``--shards`` the replay table
split over N nodes' shard daemons (``shmreplay.ray.ShardedTable``).

* ``--ray`` alone: the daemon, the replay table and the learner stay on
  this node; actors write through an ingest actor pinned here and read the
  learner's weights through a relay (docs/scaling.md).
* ``--shards N``: a shard daemon on each of N nodes (this node first, then
  the others by id), the table's capacity split over them; each actor
  writes through a ``ShardedWriter``: to its own node's shard through
  shared memory, or in turn over the shards' ingests from a node without
  one.  The learner draws each batch over the shards by their priority
  mass (``ShardedTable.iterate``), gathers this node's rows from shared
  memory and the others' as one array per shard through Ray's object
  store, and sends each priority update to the shard its key came from.
  The weights board stays on this node's private daemon.
"""

from __future__ import annotations

import math
import os

import shmreplay

import dqn  # clients/dqn.py
from apex_actor import act  # clients/apex_actor.py


def connect(args) -> None:
    """Join the cluster at ``--ray``; the workers import dqn and this
    module (the actors' code refers to them) from a copy of this folder."""
    import ray
    ray.init(address=args.ray, runtime_env={"working_dir": os.path.dirname(os.path.abspath(dqn.__file__))},
             logging_level="ERROR", log_to_driver=False)


def sharded_replay(args, table: dict):
    """``--shards N``: a shard daemon on each of N nodes and the replay
    table over them (``table``: apex_dqn's definition; ``capacity`` and
    ``min_size_to_sample`` are the whole table's, split over the shards).
    Returns (the shards, the ShardedTable)."""
    import ray
    import shmreplay.ray as sray
    here = ray.get_runtime_context().get_node_id()
    nodes = [here] + sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    if len(nodes) < args.shards:
        raise SystemExit(f"apex_dqn: --shards {args.shards} needs as many nodes; the cluster has {len(nodes)}")
    # the shards' daemons are named after --instance (each <instance>s<k>)
    shards = sray.start_shards(nodes[:args.shards], instance=args.instance)
    spec = {k: v for k, v in table.items() if k not in ("name", "capacity", "fields", "frames")}
    spec["min_size_to_sample"] = max(1, math.ceil(spec.get("min_size_to_sample", 1) / args.shards))
    try:
        return shards, sray.ShardedTable.create(shards, table["name"], table["capacity"], table["fields"],
                                                seed=args.seed, **spec)
    except BaseException:
        sray.stop_shards(shards)
        raise


def sharded_batches(replay, args, stop):
    """The learner's tensor batches drawn over the shards, two ahead,
    until ``--max-batches`` or ``stop()`` (asked at least once a second,
    also while the actors fill the shards)."""
    import shmreplay.torch as srt
    done = 0
    with replay.iterate(args.batch, args.beta, prefetch=2,
                        buffers=lambda: srt.tensor_batch(replay, args.batch)) as batches:
        while not (args.max_batches and done >= args.max_batches) and not stop():
            b = batches.next_within(1.0)
            if b is not None:
                done += 1
                yield b


class RayActor:
    """An actor on any node of a Ray cluster (``--ray``): writes through the
    ingest on the replay node, or through a ``ShardedWriter`` over the
    shards (``sink``: the ingest, or the shards), reads weights through the
    relay on the learner's node."""

    def __init__(self, index, args, eps, sink, relay):
        self.index, self.args, self.eps, self.sink, self.relay = index, args, eps, sink, relay
        self.steps, self.episodes, self.stop = 0, [], False

    def run(self) -> None:
        import ray
        import shmreplay.ray as sray
        args = self.args

        def episode(e, ret):
            self.episodes.append((e, ret))

        def stepped(n):
            self.steps += n

        def target():
            return sray.ShardedWriter(self.sink, "replay", chunk=32) if isinstance(self.sink, list) else self.sink
        act(self.index, args, self.eps, shmreplay.actor_steps(None, stop=lambda: self.stop),
            writer=lambda prio: sray.RemoteNStepWriter(target(), n=args.n_step, gamma=args.gamma,
                                                       priority_fn=prio, chunk=32),
            latest=lambda v: ray.get(self.relay.latest.remote(v)),
            episode=episode, stepped=stepped)

    def report(self) -> tuple:
        """Env steps so far and the episodes finished since the last report."""
        out, self.episodes = self.episodes, []
        return self.steps, out

    def finish(self) -> None:
        self.stop = True


class RayCrew:
    """Actors as Ray actors anywhere in the cluster at ``--ray`` (with
    ``--actor-resource NAME``, only on nodes that offer NAME); the daemon,
    the ingest (or, with ``shards``, the shards' hosts) and the weights
    relay stay where they are.  ``stop`` ends the actors, the shards, and
    this process's part in the cluster."""

    def __init__(self, args, eps, server, client, like, shards=None):
        import ray
        import shmreplay.ray as sray
        self.ray, self.shards = ray, shards
        self.ingest = None if shards else sray.start_ingest(server.socket, "replay")
        self.relay = sray.start_parameter_relay(server.socket, "policy", like)
        opts = dict(num_cpus=1, max_concurrency=2)
        if args.actor_resource:
            opts["resources"] = {args.actor_resource: 1}
        cls = ray.remote(RayActor).options(**opts)
        sink = list(shards) if shards else self.ingest
        self.actors = [cls.remote(a, args, eps[a * args.envs:(a + 1) * args.envs], sink, self.relay)
                       for a in range(args.actors)]
        self.runs = [x.run.remote() for x in self.actors]
        self.counts = [0] * len(self.actors)
        self._episodes: list = []

    @property
    def steps(self) -> int:
        return sum(self.counts)

    def episodes(self) -> list:
        for i, (n, eps) in enumerate(self.ray.get([x.report.remote() for x in self.actors], timeout=60)):
            self.counts[i] = n
            self._episodes += eps
        out, self._episodes = self._episodes, []
        return out

    def failed(self) -> bool:
        done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return bool(done)  # a run ends only when told to: one that ended failed

    def stop(self) -> None:
        ray = self.ray
        try:
            self.episodes()  # the last counts
            ray.get([x.finish.remote() for x in self.actors], timeout=60)
            # an actor whose writer waits for the rate limiter (the learner has
            # stopped sampling) never gets to look: it is killed below
            ray.wait(self.runs, num_returns=len(self.runs), timeout=2)
        finally:
            for x in [*self.actors, self.relay] + ([self.ingest] if self.ingest is not None else []):
                ray.kill(x)
            if self.shards:
                import shmreplay.ray as sray
                sray.stop_shards(self.shards)
            ray.shutdown()
