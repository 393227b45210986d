"""An actor or a learner for tests/fault/test_memory_cgroup.py, run as its own
process (inside the test's memory cgroup, started through a shell that joins
it and then execs this, so nothing of it is allocated outside).

Row ``i`` is ``id = i`` and ``obs[j] = i << 16 | j`` (uint64): every 8-byte
word of the table is different, so a row that holds another row's page, a
stale page or a hole fails the check, not only a torn one.

    cgroup_client.py actor   SOCKET TABLE CAPACITY ROW_WORDS BATCH
    cgroup_client.py learner SOCKET TABLE CAPACITY BATCH

The actor creates the table as a queue (fifo, each item delivered once; its
rows go in a file: the daemon's default ``storage_dir``) and fills it to
capacity; the learner drains it, checking every row.  Each prints one JSON
line: what it did and the peak of its anonymous resident memory (RssAnon,
read after every batch), which must be the interpreter's plus a batch or
two, never the rows it streamed.
"""

import json
import os
import sys

# the repository's package, not an installed copy (this file runs as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import shmreplay  # noqa: E402


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def expected(ids: np.ndarray, words: int) -> np.ndarray:
    return (ids.astype(np.uint64)[:, None] << np.uint64(16)) | np.arange(words, dtype=np.uint64)


def actor(sock: str, table: str, capacity: int, words: int, batch: int) -> dict:
    peak = rss_anon()
    with shmreplay.connect(sock, timeout=60) as c:
        t = c.create_queue(table, capacity, {"obs": ("uint64", (words,)), "id": ("int64", ())})
        for lo in range(0, capacity, batch):
            ids = np.arange(lo, min(capacity, lo + batch), dtype=np.int64)
            t.insert_batch({"obs": expected(ids, words), "id": ids}, timeout=120)
            peak = max(peak, rss_anon())
        c.flush()
        return {"inserted": capacity, "size": len(t), "file_backed": t.spec.file_backed,
                "rss_anon_peak": max(peak, rss_anon())}


def learner(sock: str, table: str, capacity: int, batch: int) -> dict:
    seen = np.zeros(capacity, dtype=np.int64)
    bad, peak, out = [], rss_anon(), None
    with shmreplay.connect(sock, timeout=60) as c:
        t = c.table(table)
        words = t.spec.field("obs").shape[0]
        for lo in range(0, capacity, batch):
            out = t.sample(min(batch, capacity - lo), out=out if lo + batch <= capacity else None,
                           timeout=120)
            ids = out.data["id"]
            ok = (ids >= 0) & (ids < capacity)
            good = np.all(out.data["obs"] == expected(np.where(ok, ids, 0), words), axis=1) & ok
            bad += ids[~good].tolist()
            np.add.at(seen, ids[ok], 1)
            peak = max(peak, rss_anon())
        return {"sampled": int(seen.sum()), "once": int(np.sum(seen == 1)), "bad": bad[:20],
                "n_bad": len(bad), "left": len(t), "rss_anon_peak": max(peak, rss_anon())}


def main(argv) -> int:
    role, sock, table, *nums = argv
    nums = [int(x) for x in nums]
    result = actor(sock, table, *nums) if role == "actor" else learner(sock, table, *nums)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
