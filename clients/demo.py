#!/usr/bin/env python3
"""The main job: daemon with the bundled config, actors and a learner, throughput.

    python clients/demo.py [--seconds 15] [--actors 2] [--chunk 1] [--batch 256] [--instance NAME]

Starts ``shmreplayd`` with daemon/shmreplayd.toml on a private socket
(``shmreplay.Server``),
runs ``--actors`` copies of clients/actor.py and one clients/learner.py
against its "demo" table, prints inserts/s and learner batches/s once a
second from the daemon's counters, then stops everything with SIGTERM and
checks that nothing was left in /dev/shm.  ``--instance``: the daemon's
instance name, which every object it makes carries (default
``demo<pid>``; a test gives one it can look for).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "daemon", "shmreplayd.toml"))
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--instance", default=None, help="the daemon's instance name (default demo<pid>)")
    args = ap.parse_args(argv)

    import shmreplay
    instance = args.instance or f"demo{os.getpid()}"
    print(f"starting shmreplayd ({args.config})", flush=True)
    server = shmreplay.Server(config=args.config, instance=instance)
    env = dict(os.environ, SHMREPLAY_SOCKET=server.socket)
    workers = []
    try:
        client = server.connect()
        print(f"daemon up; {args.actors} actor(s) x chunk {args.chunk}, 1 learner x batch "
              f"{args.batch}, {args.seconds:.0f} s", flush=True)
        for i in range(args.actors):
            workers.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "actor.py"), "--seconds", str(args.seconds),
                 "--chunk", str(args.chunk), "--seed", str(i)], env=env, stdout=subprocess.PIPE))
        workers.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "learner.py"), "--seconds", str(args.seconds),
             "--batch", str(args.batch)], env=env, stdout=subprocess.PIPE))

        def counters():
            t = client.stats()["tables"]["demo"]
            return time.monotonic(), t["inserts"], t["sample_calls"], t["size"]

        last = counters()
        while any(w.poll() is None for w in workers):
            time.sleep(1.0)
            now = counters()
            dt = now[0] - last[0]
            print(f"  inserts/s {(now[1] - last[1]) / dt:9.0f}   batches/s {(now[2] - last[2]) / dt:7.1f}"
                  f"   table size {now[3]}", flush=True)
            last = now
        results = [json.loads(w.stdout.read().decode().strip().splitlines()[-1]) for w in workers]
        client.close()
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
            w.wait(timeout=30)
        code = server.stop(check=False)
    inserts = sum(r["inserted"] for r in results if r["role"] == "actor")
    ins_rate = sum(r["inserts_per_s"] for r in results if r["role"] == "actor")
    learner = next(r for r in results if r["role"] == "learner")
    print(f"\nresult: {inserts} items inserted by {args.actors} actor(s), "
          f"{ins_rate:.0f} inserts/s ({ins_rate * 28233 / 1e6:.0f} MB/s); "
          f"learner {learner['batches_per_s']:.1f} batches/s of {args.batch} "
          f"({learner['batches_per_s'] * args.batch * 28233 / 1e6:.0f} MB/s gathered), "
          f"{learner['redrawn_rows']} rows redrawn")
    left = [n for n in os.listdir("/dev/shm") if f".{instance}." in n]
    print(f"daemon exited with code {code}; shared memory left behind: {left or 'none'}")
    return 0 if code == 0 and not left else 1


if __name__ == "__main__":
    sys.exit(main())
