"""Small chunks held back by the ingest and inserted as one batch.

A 64-row sac-mujoco chunk is ~11 KB: its ``insert_batch`` costs the ingest
more in per-call work (checks, a commit record, a drain of the reply ring)
than in copying, and the daemon applies one commit per chunk.  Inserting the
chunks that arrive between two flushes as one concatenated batch halves
both (measured back to back, one process: client 40 -> 24 us, daemon 47 ->
32 us per chunk).  For large chunks the concatenation is one more copy of
every byte and gains nothing (dqn-atari, 7 MB: client 236 -> 456 us), so
only chunks up to ``CHUNK_BYTES`` wait here.

Who calls it: the ingest (ingest.py), one call at a time.
"""

from __future__ import annotations

import time

import numpy as np

# A chunk this small or smaller waits to be inserted with the others; the
# concatenation's copy of it (~13 us at 5 GB/s) is well under what its own
# insert would cost (~40 us warm, two or three times that in a busy actor).
CHUNK_BYTES = 64 << 10
# Held chunks are inserted once they add up to this much, whatever the
# flush schedule: it bounds the ingest's extra memory and each copy.
BATCH_BYTES = 1 << 20
# ... and once the first of them has waited this long with no call to
# insert them (the ingest's thread does): a producer that goes quiet
# leaves nothing unsampleable for long.  Under steady traffic a flush
# comes sooner (16 chunks of a 64-row sac producer: ~16 ms here).
HOLD_S = 0.05


class Coalescer:
    """Checked chunks waiting for one insert, kept in arrival order as
    runs: a run's chunks all carry priorities or all leave them to the
    table (the max so far), so each run is one ``insert_batch``."""

    def __init__(self):
        self.clear()

    def add(self, chunk: dict, priorities, nbytes: int, tag) -> None:
        """Hold a chunk the caller checked (fields, shapes, priorities);
        ``tag`` comes back with its batch."""
        has = priorities is not None
        if not self.chunks:
            self.since = time.monotonic()
        if not self.runs or self.runs[-1][0] != has:
            self.runs.append((has, []))
        self.runs[-1][1].append((chunk, priorities, tag))
        self.bytes += nbytes
        self.chunks += 1

    @property
    def full(self) -> bool:
        return self.bytes >= BATCH_BYTES

    def take(self) -> list[tuple[dict, np.ndarray | None, list]]:
        """The held chunks as batches, one per run (the caller inserts them
        in order), each with its chunks' tags; nothing is held any more."""
        out = []
        for has, run in self.runs:
            tags = [t for _, _, t in run]
            if len(run) == 1:
                out.append((run[0][0], run[0][1], tags))
                continue
            batch = {k: np.concatenate([c[k] for c, _, _ in run]) for k in run[0][0]}
            out.append((batch, np.concatenate([p for _, p, _ in run]) if has else None, tags))
        self.clear()
        return out

    def clear(self) -> None:
        self.runs: list[tuple[bool, list]] = []  # (has priorities, [(chunk, priorities, tag)])
        self.bytes = self.chunks = 0
        self.since = 0.0  # when the first chunk held now came (time.monotonic)
