#!/usr/bin/env python3
"""Ape-X DQN on one box: actor processes feed a prioritized replay table, one learner trains.

    python clients/apex_dqn.py --target-return 475 --max-minutes 15 --seed 0

* A private shmreplayd (``shmreplay.Server``) holds the replay table
  (prioritized, alpha 0.6, fifo remover) with a samples-per-insert limit,
  and a ``ParameterBoard`` with the learner's network.
* ``--actors`` processes (default 2) each step ``--envs`` copies of
  ``--env`` (default CartPole-v1; any discrete-action gymnasium id; Atari
  ids such as ALE/Pong-v5 get the standard wrappers) with their own
  epsilons from the Ape-X ladder, write 3-step transitions through
  ``NStepWriter`` with actor-side initial priorities (|TD error| under the
  actor's network), and refresh the network from the board every
  ``--sync-every`` steps.
* The learner (this process) trains Double DQN through
  ``shmreplay.torch.iterate`` (rows gathered straight into tensors, two
  batches prefetched), importance weights, priority updates, a target
  network, and publishes its weights every ``--publish-every`` updates.

Once a second it prints env steps/s, inserts/s, batches/s and the recent
return: the mean of the last 20 episodes of the envs whose epsilon is at
most 0.01 (the near-greedy end of the ladder; Ape-X's other envs explore).
At the end it writes ``apex_dqn.csv`` and ``apex_dqn.png`` (the learning
curve) under ``--out``.  Exit code 0: ``--target-return`` reached;
1: ``--max-minutes`` passed (or ``--max-batches`` were done) first; 2: an
actor failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import dqn  # noqa: E402
import shmreplay  # noqa: E402

GREEDY_EPS = 0.01


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="CartPole-v1")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs", type=int, default=4, help="environments per actor")
    ap.add_argument("--target-return", type=float, default=475.0)
    ap.add_argument("--max-minutes", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batches", type=int, default=None,
                    help="stop after this many learner batches (a smoke run; exit code 1)")
    ap.add_argument("--capacity", type=int, default=None, help="default 100,000 (20,000 for Atari)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--n-step", type=int, default=3)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--samples-per-insert", type=float, default=8.0, help="0: no rate limit")
    ap.add_argument("--min-size", type=int, default=1000)
    ap.add_argument("--beta", type=float, default=0.4)
    ap.add_argument("--sync-every", type=int, default=100, help="actor steps between weight refreshes")
    ap.add_argument("--publish-every", type=int, default=25, help="learner updates between publishes")
    ap.add_argument("--target-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner")
    ap.add_argument("--device", default="cpu", help="the learner's torch device (cuda where there is one)")
    ap.add_argument("--out", default=".", help="where the CSV and PNG go")
    ap.add_argument("--instance", default=None, help="shared-memory name prefix of the private daemon")
    return ap.parse_args(argv)


# ---- actors ----
def actor(index: int, args, client, eps: list, stop, episodes, steps) -> None:
    """One actor process: ``len(eps)`` envs stepped together, one
    NStepWriter each (an env's steps form one stream)."""
    import torch
    import shmreplay.torch as srt
    torch.set_num_threads(1)
    episodes.cancel_join_thread()  # exit even if the learner stopped reading episodes
    table = client.table("replay")
    fields, actions = dqn.env_fields(args.env)
    net = dqn.q_network(fields["obs"][1], actions)
    board = shmreplay.ParameterBoard.attach(client, "policy", like=srt.numpy_state(net))
    version, arrays = board.latest(timeout=60.0)
    srt.load_state(net, arrays)
    rng = np.random.default_rng([args.seed, index])
    envs = [dqn.make_env(args.env, args.seed * 1000 + index * 100 + i) for i in range(len(eps))]
    writers = [shmreplay.NStepWriter(table, n=args.n_step, gamma=args.gamma,
                                     priority_fn=dqn.td_priority(net), timeout=0.5) for _ in envs]
    obs = np.stack([e.reset()[0] for e in envs])
    returns = np.zeros(len(envs))
    t = 0
    try:
        while not stop.is_set():
            if t % args.sync_every == 0:
                got = board.latest(newer_than=version)
                if got is not None:
                    version, arrays = got
                    srt.load_state(net, arrays)
            act = dqn.greedy(net, obs)
            explore = rng.random(len(envs)) < eps
            act[explore] = rng.integers(actions, size=int(explore.sum()))
            for i, env in enumerate(envs):
                o2, r, term, trunc, _ = env.step(int(act[i]))
                while not stop.is_set():  # the limiter holds actors while the learner catches up
                    try:
                        writers[i].append(obs=obs[i], action=act[i], reward=r, next_obs=o2,
                                          terminated=term, truncated=trunc)
                        break
                    except shmreplay.RateLimited:
                        continue
                returns[i] += r
                if term or trunc:
                    episodes.put((eps[i], float(returns[i])))
                    returns[i] = 0.0
                    o2, _ = env.reset()
                obs[i] = o2
            t += 1
            steps.value += len(envs)
    finally:
        for w in writers:
            w.close(timeout=5.0)
        client.close()


# ---- learner ----
def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import shmreplay.torch as srt
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    fields, actions = dqn.env_fields(args.env)
    atari = len(fields["obs"][1]) == 3
    capacity = args.capacity or (20_000 if atari else 100_000)
    spi = args.samples_per_insert
    table = dict(name="replay", capacity=capacity, fields=fields, sampler="prioritized", alpha=0.6,
                 remover="fifo", min_size_to_sample=args.min_size)
    if spi > 0:  # 0: no limit (actors and learner each as fast as they go)
        table.update(samples_per_insert=spi, error_buffer=max(2.0 * args.batch, 200.0 * spi))
    eps = dqn.epsilon_ladder(args.actors * args.envs)
    progress = dqn.Progress(args.out, "apex_dqn")
    ctx = mp.get_context("spawn")
    stop, episodes = ctx.Event(), ctx.Queue()
    counters = [ctx.Value("q", 0, lock=False) for _ in range(args.actors)]
    procs: list = []
    code, reached = 1, None
    print(f"apex_dqn: {args.env}, {args.actors} actors x {args.envs} envs, replay {capacity:,} items, "
          f"{spi:g} samples per insert, batch {args.batch}, seed {args.seed}", flush=True)
    with shmreplay.Server(tables=[table], instance=args.instance) as server:
        client = server.connect()
        replay = client.table("replay")
        learner = dqn.DoubleDQN(fields["obs"][1], actions, lr=args.lr, target_every=args.target_every,
                                device=args.device)
        board = shmreplay.ParameterBoard.create(client, "policy", like=srt.numpy_state(learner.online))
        board.publish(srt.numpy_state(learner.online), flush=True)
        for a in range(args.actors):
            p = ctx.Process(target=actor, args=(a, args, client, eps[a * args.envs:(a + 1) * args.envs],
                                                stop, episodes, counters[a]), name=f"actor{a}")
            p.start()
            procs.append(p)
        deadline = started + 60.0 * args.max_minutes
        next_tick = time.monotonic() + 1.0
        batches = 0

        def report() -> bool:
            """Episodes in, a progress line once a second; True: stop."""
            nonlocal next_tick, code, reached
            while True:
                try:
                    e, ret = episodes.get_nowait()
                except queue.Empty:
                    break
                if e <= GREEDY_EPS:
                    progress.episode(ret)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + 1.0
                progress.tick(sum(c.value for c in counters), replay.inserts, batches)
            if len(progress.returns) == progress.returns.maxlen and progress.recent >= args.target_return:
                code, reached = 0, now - started
                return True
            if any(p.exitcode not in (None, 0) for p in procs):
                code = 2
                print("apex_dqn: an actor failed", file=sys.stderr)
                return True
            return now > deadline

        while not replay.can_sample(args.batch):  # warm-up: actors fill min_size
            if report():
                break
            time.sleep(0.05)
        if code == 1 and time.monotonic() <= deadline:
            # timeout: a batch the limiter holds for 60 s means the actors stopped
            with srt.iterate(replay, args.batch, beta=args.beta, prefetch=2, timeout=60.0) as it:
                for b in it:
                    d = b if args.device == "cpu" else b.to(args.device)  # non_blocking from pinned
                    prios = learner.step(d.data, d.weights)
                    replay.update_priorities(b.keys, prios + 1e-3)
                    batches += 1
                    if batches % args.publish_every == 0:
                        board.publish(srt.numpy_state(learner.online))
                    if report() or batches == args.max_batches:
                        break
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
                p.join(10)
        client.close()
    csv_path, png_path = progress.save()
    steps = sum(c.value for c in counters)
    if code == 0:
        print(f"apex_dqn: reached a mean return of {progress.recent:.1f} (>= {args.target_return:g}) "
              f"after {reached:.1f} s, {steps:,} env steps, {batches:,} batches", flush=True)
    elif code == 1:
        print(f"apex_dqn: stopped ({args.max_minutes:g} min or --max-batches); recent return {progress.recent:.1f} "
              f"after {steps:,} env steps, {batches:,} batches", flush=True)
    print(f"apex_dqn: wrote {csv_path} and {png_path}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
