#!/usr/bin/env python3
"""SEED-style DQN on one box: env processes only step environments; one central process acts, writes and trains.

    python clients/seed_learner.py --target-return 475 --max-minutes 15 --seed 0

* ``--envs`` env processes (default 4) each step one ``--env`` (default
  CartPole-v1) and talk to the central process through a
  ``shmreplay.InferenceServer``: they post (observation, the reward and
  end flags of their last action), and wait for the action.
* The central process's inference thread takes every posted request at
  once, runs the policy for all of them in one forward pass (epsilon from
  the Ape-X ladder, one epsilon per env), answers, and writes each env's
  transitions into a locally attached replay table through one
  ``NStepWriter`` per env.
* Its training thread runs Double DQN from the same table through
  ``shmreplay.torch.iterate`` (importance weights, priority updates, a
  target network) under a samples-per-insert limit, and hands the
  inference thread fresh weights every ``--publish-every`` updates.  The
  two threads never wait for each other: training waits only for the
  rate limiter, which the inference thread's inserts open.
* A private shmreplayd (``shmreplay.Server``) holds the table.

Once a second it prints env steps/s, inserts/s, batches/s, the mean
round-trip time of an env's step through the channel, and the recent
return (last 20 episodes of the envs whose epsilon is at most 0.01).  At
the end: ``seed_learner.csv`` and ``seed_learner.png`` (against env steps, with the
target) into ``--out`` (default: a run folder, ``runs/seed_learner-<env>-seed<N>-<time>``).
Exit code 0: ``--target-return`` reached; 3: ``--max-minutes`` passed (or
``--max-batches`` were done); 2: every env process died; 1: an error (an
uncaught exception).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time

import numpy as np

import shmreplay

import dqn  # clients/dqn.py, found because a script's own folder is first on sys.path

GREEDY_EPS = 0.01


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dqn.learner_flags(ap)
    ap.add_argument("--envs", type=int, default=4, help="env processes")
    ap.add_argument("--channel-prefix", default=None, help="name prefix of the inference channel")
    return ap.parse_args(argv)


# ---- env processes ----
def env_process(address: str, env_id: str, seed: int, calls) -> None:
    """Step one env; every step is one round trip through the channel.
    ``calls``: [count, total seconds] of this env's round trips."""
    ch = shmreplay.InferenceClient(address, timeout=120.0)
    env = dqn.make_env(env_id, seed)
    obs, _ = env.reset(seed=seed)
    last, reward, term, trunc, first = obs, 0.0, False, False, True
    try:
        while True:
            t0 = time.perf_counter()
            action = int(ch.call(obs=obs, last_obs=last, reward=reward, terminated=term,
                                 truncated=trunc, first=first)["action"])
            calls[0] += 1
            calls[1] += time.perf_counter() - t0
            last, reward, term, trunc, _ = env.step(action)
            first = False
            obs = env.reset()[0] if term or trunc else last
    except shmreplay.InferenceClosed:
        pass  # the learner is done
    finally:
        ch.close()


# ---- the central process ----
class Trainer(threading.Thread):
    """The training thread: its own client, the iterator, priority
    updates; hands weights to the inference thread through ``weights``."""

    def __init__(self, args, client, learner, stop):
        super().__init__(name="trainer", daemon=True)
        self.args, self.client, self.learner, self.stop = args, client, learner, stop
        self.batches, self.error = 0, None
        self.lock = threading.Lock()
        self.weights = None  # a state_dict copy, newest first

    def run(self) -> None:
        import shmreplay.torch as srt
        args, learner = self.args, self.learner
        table = self.client.table("replay")
        try:
            while not table.can_sample(args.batch):
                if self.stop.wait(0.05):
                    return
            with srt.iterate(table, args.batch, beta=args.beta, prefetch=2, timeout=0.5) as it:
                while not self.stop.is_set():
                    try:
                        b = next(it)
                    except shmreplay.RateLimited:   # the limiter holds us: inserts are behind
                        it.close()
                        it = srt.iterate(table, args.batch, beta=args.beta, prefetch=2, timeout=0.5)
                        continue
                    d = b if args.device == "cpu" else b.to(args.device)
                    prios = learner.step(d.data, d.weights)
                    table.update_priorities(b.keys, prios + 1e-3)
                    self.batches += 1
                    if self.batches % args.publish_every == 0:
                        state = {k: v.detach().clone() for k, v in learner.online.state_dict().items()}
                        with self.lock:
                            self.weights = state
                    if args.max_batches is not None and self.batches >= args.max_batches:
                        break  # exactly --max-batches: the env loop may look only rounds later
                it.close()
        except BaseException as exc:  # reported by the inference loop
            self.error = exc
        finally:
            self.client.close()

    def take_weights(self):
        with self.lock:
            w, self.weights = self.weights, None
        return w


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    started = time.monotonic()
    fields, actions = dqn.env_fields(args.env)
    obs_dtype, obs_shape = fields["obs"]
    capacity = args.capacity or (20_000 if len(obs_shape) == 3 else 100_000)
    spi = args.samples_per_insert
    table = dict(name="replay", capacity=capacity, fields=fields, sampler="prioritized", alpha=0.6,
                 remover="fifo", min_size_to_sample=args.min_size)
    if spi > 0:  # 0: no limit (actors and learner each as fast as they go)
        table.update(samples_per_insert=spi, error_buffer=max(2.0 * args.batch, 200.0 * spi))
    request = {"obs": (obs_dtype, obs_shape), "last_obs": (obs_dtype, obs_shape),
               "reward": ("float32", ()), "terminated": ("bool", ()), "truncated": ("bool", ()),
               "first": ("bool", ())}
    eps = np.array(dqn.epsilon_ladder(args.envs))
    rng = np.random.default_rng(args.seed)
    progress = dqn.Progress(dqn.run_dir(args, "seed_learner"), "seed_learner", title=dqn.title("seed_learner", args),
                            target=args.target_return)
    ctx = mp.get_context("spawn")
    code, reached = dqn.NOT_REACHED, None
    print(f"seed_learner: {args.env}, {args.envs} env processes, replay {capacity:,} items, "
          f"{spi:g} samples per insert, batch {args.batch}, seed {args.seed}", flush=True)
    with shmreplay.Server(tables=[table], instance=args.instance) as server, \
            shmreplay.InferenceServer(request, {"action": ("int64", ())}, slots=args.envs,
                                      prefix=args.channel_prefix) as channel:
        client = server.connect()
        replay = client.table("replay")
        learner = dqn.DoubleDQN(obs_shape, actions, lr=args.lr, target_every=args.target_every,
                                device=args.device)
        policy = dqn.q_network(obs_shape, actions)
        policy.load_state_dict(learner.online.state_dict())
        calls = [ctx.Array("d", 2, lock=False) for _ in range(args.envs)]
        procs = [ctx.Process(target=env_process, args=(channel.address, args.env, args.seed * 100 + i,
                                                       calls[i]), name=f"env{i}")
                 for i in range(args.envs)]
        for p in procs:
            p.start()
        channel.wait_attached(args.envs, timeout=120.0)
        channel.seal()  # every env is in: unlink the names, so a crash leaves none behind
        stop = threading.Event()
        trainer = Trainer(args, server.connect(), learner, stop)
        trainer.start()
        writers = [shmreplay.NStepWriter(replay, n=args.n_step, gamma=args.gamma, timeout=0.5)
                   for _ in range(args.envs)]
        returns = np.zeros(args.envs)
        prev_obs = np.zeros((args.envs, *obs_shape), obs_dtype)
        prev_action = np.zeros(args.envs, np.int64)
        alive = args.envs
        deadline = started + 60.0 * args.max_minutes
        next_tick = time.monotonic() + 1.0
        last_calls = (0.0, 0.0)
        steps = 0
        try:
            while True:
                batch = channel.receive(min_batch=alive, max_wait_s=0.002, timeout=60.0)
                for s in batch.lost:
                    alive -= 1
                    writers[s].close(timeout=5.0)  # its unfinished n-step items are dropped
                    writers[s] = None
                    print(f"seed_learner: env process of slot {s} died; {alive} left", file=sys.stderr)
                if alive == 0:
                    code = 2
                    break
                slots, d = batch.slots, batch.data
                for j, s in enumerate(slots):
                    if d["first"][j]:
                        continue
                    while True:  # the limiter holds writers while the learner catches up
                        try:
                            writers[s].append(obs=prev_obs[s], action=prev_action[s], reward=d["reward"][j],
                                              next_obs=d["last_obs"][j], terminated=d["terminated"][j],
                                              truncated=d["truncated"][j])
                            break
                        except shmreplay.RateLimited:
                            if trainer.error is not None or not trainer.is_alive():
                                raise RuntimeError("training stopped") from trainer.error
                    returns[s] += d["reward"][j]
                    if d["terminated"][j] or d["truncated"][j]:
                        if eps[s] <= GREEDY_EPS:
                            progress.episode(returns[s])
                        returns[s] = 0.0
                steps += len(slots)
                w = trainer.take_weights()
                if w is not None:
                    policy.load_state_dict(w)
                act = dqn.greedy(policy, d["obs"])
                explore = rng.random(len(slots)) < eps[slots]
                act[explore] = rng.integers(actions, size=int(explore.sum()))
                channel.respond(slots, action=act)
                prev_obs[slots] = d["obs"]
                prev_action[slots] = act
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + 1.0
                    n, total = sum(c[0] for c in calls), sum(c[1] for c in calls)
                    rtt = (total - last_calls[1]) / max(n - last_calls[0], 1) * 1e6
                    last_calls = (n, total)
                    progress.tick(steps, replay.inserts, trainer.batches, f"  step round trip {rtt:6.0f} us")
                if trainer.error is not None:
                    raise RuntimeError("training failed") from trainer.error
                if len(progress.returns) == progress.returns.maxlen and progress.recent >= args.target_return:
                    code, reached = 0, now - started
                    break
                if now > deadline or (args.max_batches is not None and trainer.batches >= args.max_batches):
                    break
        finally:
            stop.set()
            channel.close()  # env processes see InferenceClosed and exit
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()
                    p.join(10)
            trainer.join(30)
            for wr in writers:
                if wr is not None:
                    wr.close(timeout=5.0)
            progress.tick(steps, replay.inserts, trainer.batches)  # the last row: where the run ended
            client.close()
    csv_path, png_path = progress.save()
    n, total = sum(c[0] for c in calls), sum(c[1] for c in calls)
    rtt = total / max(n, 1) * 1e6
    if code == 0:
        print(f"seed_learner: reached a mean return of {progress.recent:.1f} (>= {args.target_return:g}) "
              f"after {reached:.1f} s, {steps:,} env steps, {trainer.batches:,} batches, "
              f"mean step round trip {rtt:.0f} us", flush=True)
    elif code == dqn.NOT_REACHED:
        print(f"seed_learner: stopped ({args.max_minutes:g} min or --max-batches); recent return {progress.recent:.1f} "
              f"after {steps:,} env steps, {trainer.batches:,} batches, mean step round trip {rtt:.0f} us",
              flush=True)
    print(f"seed_learner: wrote {csv_path} and {png_path}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
