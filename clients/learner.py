#!/usr/bin/env python3
"""A learner: samples prioritized batches and updates their priorities.

    python clients/learner.py --table demo --seconds 15 --batch 256

Stands in for a training step: gathers a batch (zero-copy indices from the
daemon, rows read straight from shared memory), computes fake TD errors
from the rows, and sends them back as new priorities.  Prints one JSON line
of totals when it stops.  Its --seconds count from its first batch (it
waits up to FIRST_BATCH_S for the actors' first items): a learner started
before its actors have inserted anything still samples that long.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import numpy as np

import shmreplay

FIRST_BATCH_S = 120.0  # the longest it waits for the first batch it can draw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=None)
    ap.add_argument("--table", default="demo")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--beta", type=float, default=0.4)
    args = ap.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))

    with shmreplay.connect(args.socket) as client:
        table = client.table(args.table)
        batches = redraws = 0
        batch = t0 = None
        start = time.monotonic()
        while not stop:
            now = time.monotonic()
            if (now - t0 >= args.seconds) if t0 is not None else (now - start >= FIRST_BATCH_S):
                break
            try:
                batch = table.sample(args.batch, beta=args.beta, out=batch, timeout=0.5)
            except shmreplay.RateLimited:
                continue  # actors have not inserted enough yet
            t0 = now if t0 is None else t0
            redraws += batch.redraws
            # a stand-in for |TD error|: anything cheap that depends on the rows
            td = np.abs(batch.data["reward"]) + 0.01
            table.update_priorities(batch.keys, td)
            batches += 1
        dt = time.monotonic() - (t0 if t0 is not None else start)
    print(json.dumps({"role": "learner", "batches": batches, "batch_size": args.batch,
                      "seconds": round(dt, 2), "batches_per_s": round(batches / dt, 1),
                      "redrawn_rows": redraws}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
