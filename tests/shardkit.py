"""What the sharded-table tests share (tests/test_shards.py,
tests/test_shard_failures.py): the table's fields, rows whose ids say
what they are, Ray tasks pinned to a node (by its label: ``replay_node``
for the head, ``remote_node_<k>``), and the chi-square bound."""

import numpy as np
import ray

FIELDS = {"id": ("int64", ()), "obs": ("float32", (8,))}
# the 1e-6 upper quantile of chi-square (Wilson-Hilferty, as test_shard_math.py)
Z_1E6 = 4.753


def chi2_bound(df: int) -> float:
    return df * (1 - 2 / (9 * df) + Z_1E6 * np.sqrt(2 / (9 * df))) ** 3


def chi2(seen: np.ndarray, p: np.ndarray) -> float:
    expected = seen.sum() * p
    return float(((seen - expected) ** 2 / expected).sum())


def rows(ids) -> dict:
    ids = np.asarray(ids, np.int64)
    return {"id": ids, "obs": (ids[:, None] % 1000 + np.arange(8)).astype(np.float32)}


def on(label: str) -> dict:
    """Ray options that put a task on the node labelled ``label``."""
    return {"num_cpus": 0, "resources": {label: 0.001}}


LABELS = ("replay_node", "remote_node_1", "remote_node_2")


@ray.remote
def write(writer, ids, priorities=None, chunk_rows=None):
    """Insert rows ``ids`` through ``writer`` (a ShardedWriter) where this
    task runs; returns the shard it wrote to locally (None: in turn)."""
    data = rows(ids)
    if chunk_rows:
        for i in range(len(ids)):
            writer.insert(priority=None if priorities is None else float(priorities[i]),
                          **{k: v[i] for k, v in data.items()})
    else:
        writer.insert_batch(data, priorities)
    writer.flush()
    shard = writer.shard
    writer.close()
    return shard


@ray.remote
def held(socket: str, table: str) -> tuple[list, list]:
    """(ids, priorities) of every committed item of ``table`` at the
    daemon ``socket``, read from its segment (a task on that node;
    readback.py), in commit order."""
    import shmreplay
    from readback import committed
    with shmreplay.connect(socket) as c:
        data, prios = committed(c.table(table))
        return data["id"].tolist(), prios.tolist()


@ray.remote
def drain(socket: str, table: str) -> int:
    """Sample ``table`` at the daemon ``socket`` one item at a time until its
    rate limit holds the next back; returns how many it drew."""
    import shmreplay
    got = 0
    with shmreplay.connect(socket) as c:
        t = c.table(table)
        while True:
            try:
                t.sample(1, timeout=0.2)
            except shmreplay.RateLimited:
                return got
            got += 1
