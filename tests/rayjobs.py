"""Two jobs on one Ray cluster, for tests/fault/test_ray_members.py: each
runs as its own driver process (``python rayjobs.py learner|intruder
...``), started by the test as the cluster's user (rayfixtures.
MemberCluster.job), and prints one JSON line of what it saw.

* ``learner SOCKET TABLE NAME``: the operator's job, set up as
  docs/reliability.md section 13 recommends: its own (anonymous, random)
  namespace; an ingest for TABLE, named NAME there only because the test
  looks for that name from the other job; 16 rows through a RemoteWriter.
  Prints ``{"namespace", "confirmed"}``, then keeps the job (and so its
  ingest) alive until its stdin closes.
* ``intruder SOCKET TABLE NAME``: a second job on the same cluster.  It
  looks for NAME from its own namespace, lists the named actors of every
  namespace, and runs a task that tries the daemon's admin operations on
  TABLE and inserts one row at priority 1e200.  Prints what each gave.

* ``sharded SOCKET TABLE``: a learner of a sharded table whose one shard
  is the daemon at SOCKET, attached as the operator's service
  (``attach_shards``): it samples 8 rows, sets their priorities to 2,
  then tries the table's drop and checkpoint.  Prints the ids it drew
  and what each call gave.

Who calls it: the test, as a subprocess; one thread."""

import json
import os
import sys

import numpy as np
import ray

FIELDS = {"id": ("int64", ()), "obs": ("float32", (8,))}  # rayproducer.FIELDS, without importing Ray actors


def rows(ids) -> dict:
    ids = np.asarray(ids, np.int64)
    return {"id": ids, "obs": (ids[:, None] % 1000 + np.arange(8)).astype(np.float32)}


def outcome(fn) -> str:
    """'ok', or the class name and message of what ``fn()`` raised."""
    try:
        fn()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@ray.remote(num_cpus=0)
def attempt(socket: str, table: str) -> dict:
    """A task of the intruding job: whose rights it has, and what the
    daemon lets it do to another job's table."""
    import shmreplay
    with shmreplay.connect(socket) as c:
        t = c.table(table)
        return {"uid": os.getuid(),
                "drop_table": outcome(lambda: c.drop_table(table)),
                "checkpoint": outcome(lambda: c.checkpoint("/tmp", tables=table)),
                "shutdown": outcome(lambda: c.shutdown()),
                # a member's right, as for any local writer (section 13)
                "insert_1e200": outcome(lambda: (t.insert_batch(rows([-1]), priorities=[1e200]), c.flush()))}


def learner(socket: str, table: str, name: str) -> None:
    import shmreplay.ray as sray
    ray.init(logging_level="ERROR", log_to_driver=False)  # no namespace=: an anonymous one of its own
    ingest = sray.start_ingest(socket, table, name=name)
    w = sray.RemoteWriter(ingest, chunk=8)
    w.insert_batch(rows(np.arange(16)))
    w.flush()
    print(json.dumps({"namespace": ray.get_runtime_context().namespace, "confirmed": w.confirmed}), flush=True)
    sys.stdin.read()  # the job, and with it its ingest, lives until the test closes our stdin
    ray.shutdown()


def intruder(socket: str, table: str, name: str) -> None:
    ray.init(logging_level="ERROR", log_to_driver=False)
    seen = {"by_name": outcome(lambda: ray.get_actor(name))}
    # Ray lists every namespace's named actors to any job: a namespace hides nothing
    seen["listed"] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name]
    seen.update(ray.get(attempt.remote(socket, table)))
    print(json.dumps(seen), flush=True)
    ray.shutdown()


def sharded(socket: str, table: str) -> None:
    import shmreplay.ray as sray
    ray.init(logging_level="ERROR", log_to_driver=False)
    shards = sray.attach_shards([(ray.get_runtime_context().get_node_id(), socket)])
    try:
        t = sray.ShardedTable(shards, table)
        b = t.sample(8)
        seen = {"uid": os.getuid(), "ids": sorted(set(b.data["id"].tolist())),
                "update": outcome(lambda: (t.update_priorities(b.keys, np.full(8, 2.0), b.shards), t.flush())),
                "drop": outcome(t.drop), "checkpoint": outcome(lambda: t.checkpoint("/tmp")),
                "size": len(t)}
        t.close()
    finally:
        sray.stop_shards(shards)  # attached: the daemon serves on, with the table
    print(json.dumps(seen), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    {"learner": learner, "intruder": intruder, "sharded": sharded}[sys.argv[1]](*sys.argv[2:])
