#!/usr/bin/env python3
"""An actor: streams fake Atari transitions into a table.

    python clients/actor.py --table demo --seconds 15 --chunk 1

Each step produces one transition (4x84x84 uint8 frames, action, reward,
done), the shape of the bundled demo table; ``--chunk`` items are inserted
per call.  Prints one JSON line of totals when it stops (after --seconds,
or on SIGTERM/SIGINT).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import numpy as np

import shmreplay


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=None)
    ap.add_argument("--table", default="demo")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))

    rng = np.random.default_rng(args.seed)
    frames = rng.integers(0, 256, size=(64, 4, 84, 84), dtype=np.uint8)  # recycled "screens"
    k = args.chunk
    with shmreplay.connect(args.socket) as client:
        table = client.table(args.table)
        inserted = 0
        t0 = time.monotonic()
        while not stop and time.monotonic() - t0 < args.seconds:
            i = inserted % 64
            idx = (np.arange(k) + i) % 64
            batch = {
                "obs": frames[idx],
                "action": rng.integers(0, 18, size=k).astype(np.int32),
                "reward": rng.standard_normal(k).astype(np.float32),
                "done": rng.random(k) < 0.01,
            }
            if k == 1:
                table.insert(**{f: v[0] for f, v in batch.items()})
            else:
                table.insert_batch(batch)
            inserted += k
        table.flush()
        dt = time.monotonic() - t0
    print(json.dumps({"role": "actor", "seed": args.seed, "inserted": inserted,
                      "seconds": round(dt, 2), "inserts_per_s": round(inserted / dt, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
