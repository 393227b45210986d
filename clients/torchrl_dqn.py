#!/usr/bin/env python3
"""TorchRL's DQN learns CartPole; its collector's worker processes write into a shmreplay table.

    python clients/torchrl_dqn.py --seed 0
    python clients/torchrl_dqn.py --seed 0 --buffer torchrl   # TorchRL's own buffer, to compare

The replay line, in a TorchRL program that has a buffer already::

    rb = shmreplay.torchrl.ReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=64, keys=KEYS)

and the collector is handed it (``replay_buffer=rb``): each of its
``--workers`` processes (default 2) steps its own CartPole-v1 with the
epsilon-greedy policy and writes its frames straight into the table (the
buffer pickles as its daemon's socket and table); no frame goes through
the main process.  The learner (this process) samples batches of 64 with
TorchRL's ``DQNLoss`` (double DQN, a target network refreshed by
``HardUpdate`` every 10 updates), 128 gradient steps after every 256 env
steps (rl-baselines3-zoo's CartPole budget, lr 2.3e-3, epsilon 1 to 0.04
over the first 8,000 steps), and hands its weights to the workers
(``update_policy_weights_``).

Since the frames never reach this process, it measures the policy itself:
every ``--eval-every`` env steps, ``--eval-episodes`` greedy episodes
(default 5) on an env of its own.  Once a second it prints env steps/s,
inserts/s, gradient steps/s and the mean greedy return of the last 10
evaluation episodes, and stops when that mean reaches ``--target-return``
(default 475) or after ``--steps`` env steps (default 60,000)::

    torchrl_dqn: buffer shmreplay, CartPole-v1 seed 0, 2 collector workers, 24576 env steps in 58 s; greedy return 500.0 (target 475): reached; <csv>, <png>

``torchrl_dqn.csv`` and ``torchrl_dqn.png`` (the curve against env steps,
the target line) go into ``--out`` (default: a run folder,
``runs/torchrl_dqn-<env>-seed<N>-<time>``).  Exit code 0: the target was
reached; 3: not within ``--steps``; 1: an error.  Needs the examples and
torchrl extras: ``pip install "shmreplay[examples,torchrl]"``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tensordict.nn import TensorDictModule, TensorDictSequential
from torchrl.collectors import MultiSyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, EGreedyModule, QValueModule
from torchrl.objectives import DQNLoss, HardUpdate

import shmreplay.torchrl

import dqn  # clients/dqn.py: the progress report and the run folder


ROUND = 256  # env steps the workers take between the learner's rounds of 128 gradient steps
KEYS = ["observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done"),
        ("next", "terminated")]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--buffer", choices=["shmreplay", "torchrl"], default="shmreplay")
    ap.add_argument("--env", default="CartPole-v1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="collector worker processes")
    ap.add_argument("--steps", type=int, default=60_000)
    ap.add_argument("--target-return", type=float, default=475.0)
    ap.add_argument("--eval-every", type=int, default=2048, help="env steps between greedy evaluations")
    ap.add_argument("--eval-episodes", type=int, default=5)
    ap.add_argument("--out", default=None,
                    help="the run folder for the CSV and PNG (default: runs/torchrl_dqn-<env>-seed<N>-<time>)")
    return ap.parse_args(argv)


class MakeEnv:
    """A picklable env maker for the collector's workers."""

    def __init__(self, env_id: str):
        self.env_id = env_id

    def __call__(self):
        return GymEnv(self.env_id)


def greedy_return(policy, env, episodes: int) -> list[float]:
    out = []
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        for _ in range(episodes):
            rollout = env.rollout(500, policy)
            out.append(float(rollout["next", "reward"].sum()))
    return out


def main(argv=None) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    env = GymEnv(args.env)
    env.set_seed(args.seed + 1000)
    spec = env.action_spec
    value = TensorDictModule(MLP(out_features=spec.shape[-1], num_cells=[256, 256]),
                             in_keys=["observation"], out_keys=["action_value"])
    policy = TensorDictSequential(value, QValueModule(spec=spec))
    value(env.reset())  # sizes the lazy layers before the workers get a copy
    explore = TensorDictSequential(policy, EGreedyModule(spec, annealing_num_steps=8000, eps_init=1.0,
                                                         eps_end=0.04))
    loss = DQNLoss(policy, action_space=spec, delay_value=True, double_dqn=True)
    loss.make_value_estimator(gamma=0.99)
    target = HardUpdate(loss, value_network_update_interval=10)
    optim = torch.optim.Adam(loss.parameters(), lr=2.3e-3)

    # the replay line: TorchRL's buffer arguments, a shmreplay table under them
    # (keys: what DQNLoss reads; the policy adds its Q-values after the
    # random first 1,000 frames, which the table need not keep)
    ours = args.buffer == "shmreplay"
    if ours:
        rb = shmreplay.torchrl.ReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=64, seed=args.seed,
                                            keys=KEYS)
    else:  # TorchRL's own, in shared memory for the workers (the collector shares it)
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=64)
    collector = MultiSyncCollector([MakeEnv(args.env)] * args.workers, explore, frames_per_batch=ROUND,
                                   total_frames=args.steps, init_random_frames=1000, replay_buffer=rb)
    collector.set_seed(args.seed)
    progress = dqn.Progress(dqn.run_dir(args, "torchrl_dqn"), "torchrl_dqn", window=10,
                            title=dqn.title("torchrl_dqn", args), target=args.target_return)
    t0 = last_tick = time.monotonic()
    steps, updates, next_eval, reached = 0, 0, args.eval_every, False
    try:
        for _ in collector:  # the workers wrote this round's frames into the table
            # the collector's count (the table's write count lags by the
            # workers' commits the daemon has not applied yet)
            steps += ROUND
            explore[-1].step(ROUND)
            if len(rb) >= 1000:
                for _ in range(128):
                    out = loss(rb.sample())
                    optim.zero_grad()
                    out["loss"].backward()
                    optim.step()
                    target.step()
                    updates += 1
                collector.update_policy_weights_()
            if steps >= next_eval:
                next_eval = steps + args.eval_every
                for ret in greedy_return(policy, env, args.eval_episodes):
                    progress.episode(ret)
                reached = len(progress.returns) == progress.returns.maxlen and progress.recent >= args.target_return
            if time.monotonic() - last_tick >= 1.0 or reached:
                progress.tick(steps, rb.write_count, updates)
                last_tick = time.monotonic()
            if reached:
                break
        if not progress.rows or progress.rows[-1]["env_steps"] != steps:
            progress.tick(steps, rb.write_count, updates)  # the CSV ends where the run did
    finally:
        collector.shutdown()
        if ours:
            rb.close()  # stops the private daemon the buffer started
    seconds = time.monotonic() - t0
    csv_path, png = progress.save()
    print(f"torchrl_dqn: buffer {args.buffer}, {args.env} seed {args.seed}, {args.workers} collector workers, {steps} env steps "
          f"in {seconds:.0f} s; greedy return {progress.recent:.1f} (target {args.target_return:g}): "
          f"{'reached' if reached else 'not reached'}; {csv_path}, {png}", flush=True)
    return 0 if reached else 3


if __name__ == "__main__":
    sys.exit(main())
