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
  ``--sync-every`` steps; ``shmreplay.actor_steps`` runs their loop (the
  rate limiter's waits, the stop).
* The learner (this process) trains Double DQN through
  ``shmreplay.torch.learner_batches`` (rows gathered straight into
  tensors, two batches prefetched, waits for the actors bounded), importance
  weights, priority updates, a target network, and publishes its weights
  every ``--publish-every`` updates.

Once a second it prints env steps/s, inserts/s, batches/s and the recent
return: the mean of the last 20 episodes of the envs whose epsilon is at
most 0.01 (the near-greedy end of the ladder; Ape-X's other envs explore).
At the end it writes ``apex_dqn.csv`` and ``apex_dqn.png`` (the learning
curve against env steps, with the target) into ``--out`` (default: a run
folder, ``runs/apex_dqn-<env>-seed<N>-<time>``).  Exit code 0: ``--target-return`` reached;
3: ``--max-minutes`` passed (or ``--max-batches`` were done) first; 2: an
actor failed; 1: an error (an uncaught exception).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import sys
import time

import shmreplay

import dqn  # clients/dqn.py, found because a script's own folder is first on sys.path
from apex_actor import act  # clients/apex_actor.py: one actor's loop, local or on a Ray node

GREEDY_EPS = 0.01


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dqn.learner_flags(ap)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs", type=int, default=4, help="environments per actor")
    ap.add_argument("--sync-every", type=int, default=100, help="actor steps between weight refreshes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner")
    ap.add_argument("--ray", metavar="ADDRESS", default=None,
                    help="run the actors as Ray actors of the cluster at ADDRESS (host:port); the daemon "
                         "and the learner stay here (docs/scaling.md)")
    ap.add_argument("--actor-resource", metavar="NAME", default=None,
                    help="with --ray: each actor asks for resources={NAME: 1}")
    ap.add_argument("--shards", type=int, default=0, metavar="N",
                    help="with --ray: split the replay table over shard daemons on N nodes (this one "
                         "first), sampled as one table (shmreplay.ray.ShardedTable, apex_ray.py)")
    ap.add_argument("--rows", action="store_true",
                    help="Atari: keep obs and next_obs stacks as rows, not as frames stored once "
                         "(a frame table, docs/frames.md: ~8x less replay memory)")
    return ap.parse_args(argv)


# ---- actors ----
def actor(index: int, args, client, eps: list, stop, episodes, steps) -> None:
    """A local actor process: writes into the table through shared memory."""
    import shmreplay.torch as srt
    episodes.cancel_join_thread()  # exit even if the learner stopped reading episodes
    table = client.table("replay")
    fields, actions = dqn.env_fields(args.env)
    board = shmreplay.ParameterBoard.attach(
        client, "policy", like=srt.numpy_state(dqn.q_network(fields["obs"][1], actions)))
    loop = shmreplay.actor_steps(table, stop=stop)

    def stepped(n):
        steps.value += n
    try:
        act(index, args, eps, loop,
            writer=lambda prio: shmreplay.NStepWriter(table, n=args.n_step, gamma=args.gamma,
                                                      priority_fn=prio, timeout=loop.timeout),
            latest=lambda v: board.latest(newer_than=v, timeout=60.0 if v is None else 0.0),
            episode=lambda e, ret: episodes.put((e, ret)), stepped=stepped)
    finally:
        client.close()


class LocalCrew:
    """Actor processes on this box (the default)."""

    def __init__(self, args, eps, server, client, like):
        ctx = mp.get_context("spawn")
        self.stop_event, self.queue = ctx.Event(), ctx.Queue()
        self.counters = [ctx.Value("q", 0, lock=False) for _ in range(args.actors)]
        self.procs = [ctx.Process(target=actor, args=(a, args, client, eps[a * args.envs:(a + 1) * args.envs],
                                                      self.stop_event, self.queue, self.counters[a]),
                                  name=f"actor{a}") for a in range(args.actors)]
        for p in self.procs:
            p.start()

    @property
    def steps(self) -> int:
        return sum(c.value for c in self.counters)

    def episodes(self) -> list:
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def failed(self) -> bool:
        return any(p.exitcode not in (None, 0) for p in self.procs)

    def stop(self) -> None:
        self.stop_event.set()
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
                p.join(10)


# ---- learner ----
def replay_memory(client, instance: str) -> str:
    """The replay table's memory a transition: its pages in /dev/shm (rows,
    frame rings, books) over the items it holds, and what it would take
    full."""
    st = client.stats()["tables"]["replay"]
    mine = (f"shmreplay.{instance}.r.replay.", f"shmreplay.{instance}.t.replay.")  # its two segments
    shm = sum(os.stat(f"/dev/shm/{n}").st_blocks * 512 for n in os.listdir("/dev/shm") if n.startswith(mine))
    full = st.get("bytes_per_item")
    return (f"replay memory: {shm / max(1, st['size']):,.0f} bytes a transition in /dev/shm "
            f"({st['size']:,} held, {shm / 2**20:,.0f} MiB)"
            + (f"; {full:,.0f} bytes a transition when full" if full else "")
            + (f"; {st['frames']['rings']['obs']['frames_per_item']} frames held an item"
               if st.get("frames") else ""))


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
    if atari and not args.rows:  # each frame of the stacks stored once (docs/frames.md)
        table["frames"] = {"obs": fields["obs"][1][0], "next_obs": "obs"}
    if spi > 0:  # 0: no limit (actors and learner each as fast as they go)
        table.update(samples_per_insert=spi, error_buffer=max(2.0 * args.batch, 200.0 * spi))
    eps = dqn.epsilon_ladder(args.actors * args.envs)
    progress = dqn.Progress(dqn.run_dir(args, "apex_dqn"), "apex_dqn", title=dqn.title("apex_dqn", args),
                            target=args.target_return)
    code, reached = dqn.NOT_REACHED, None
    print(f"apex_dqn: {args.env}, {args.actors} actors x {args.envs} envs, replay {capacity:,} items"
          f"{' as frames' if 'frames' in table else ''}, {spi:g} samples per insert, batch {args.batch}, "
          f"seed {args.seed}", flush=True)
    if args.shards and (not args.ray or "frames" in table):
        raise SystemExit("apex_dqn: --shards needs --ray, and tables of rows (--rows for Atari)")
    shards = None
    if args.ray:
        import apex_ray  # clients/apex_ray.py
        apex_ray.connect(args)
    with shmreplay.Server(tables=[] if args.shards else [table], instance=args.instance) as server:
        client = server.connect()
        if args.shards:
            shards, replay = apex_ray.sharded_replay(args, table)
        else:
            replay = client.table("replay")
        learner = dqn.DoubleDQN(fields["obs"][1], actions, lr=args.lr, target_every=args.target_every,
                                device=args.device)
        board = shmreplay.ParameterBoard.create(client, "policy", like=srt.numpy_state(learner.online))
        board.publish(srt.numpy_state(learner.online), flush=True)
        like = srt.numpy_state(learner.online)
        crew = (apex_ray.RayCrew(args, eps, server, client, like, shards) if args.ray
                else LocalCrew(args, eps, server, client, like))
        deadline = started + 60.0 * args.max_minutes
        next_tick = time.monotonic() + 1.0
        batches = 0

        def report() -> bool:
            """Episodes in, a progress line once a second; True: stop."""
            nonlocal next_tick, code, reached
            now = time.monotonic()
            if now < next_tick:
                return False
            next_tick = now + 1.0
            for e, ret in crew.episodes():
                if e <= GREEDY_EPS:
                    progress.episode(ret)
            progress.tick(crew.steps, replay.inserts, batches)
            if len(progress.returns) == progress.returns.maxlen and progress.recent >= args.target_return:
                code, reached = 0, now - started
                return True
            if crew.failed():
                code = 2
                print("apex_dqn: an actor failed", file=sys.stderr)
                return True
            return now > deadline

        # stop: report() once a second, also while the actors fill min_size; a
        # batch the actors make no progress towards for 60 s raises ReplayTimeout
        if shards:  # each update to the shard its key came from
            loop = apex_ray.sharded_batches(replay, args, report)
            update = lambda b, p: replay.update_priorities(b.keys, p, b.batch.shards)  # noqa: E731
        else:
            loop = srt.learner_batches(replay, args.batch, args.max_batches, beta=args.beta, stop=report)
            update = lambda b, p: replay.update_priorities(b.keys, p)  # noqa: E731
        with contextlib.closing(loop):
            for b in loop:
                d = b if args.device == "cpu" else b.to(args.device)  # non_blocking from pinned
                update(b, learner.step(d.data, d.weights) + 1e-3)
                batches += 1
                if batches % args.publish_every == 0:
                    board.publish(srt.numpy_state(learner.online))
        progress.tick(crew.steps, replay.inserts, batches)  # the last row: where the run ended
        if shards:
            sizes = [e.get("size") for e in replay.stats()["shards"]]
            print(f"apex_dqn: replay over {len(shards)} shards holds {sizes} transitions", flush=True)
            replay.close()
        else:
            print(f"apex_dqn: {replay_memory(client, server.instance)}", flush=True)
        crew.stop()
        client.close()
    csv_path, png_path = progress.save()
    steps = crew.steps
    if code == 0:
        print(f"apex_dqn: reached a mean return of {progress.recent:.1f} (>= {args.target_return:g}) "
              f"after {reached:.1f} s, {steps:,} env steps, {batches:,} batches", flush=True)
    elif code == dqn.NOT_REACHED:
        print(f"apex_dqn: stopped ({args.max_minutes:g} min or --max-batches); recent return {progress.recent:.1f} "
              f"after {steps:,} env steps, {batches:,} batches", flush=True)
    print(f"apex_dqn: wrote {csv_path} and {png_path}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
