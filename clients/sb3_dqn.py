#!/usr/bin/env python3
"""stable-baselines3's DQN learns CartPole with a shmreplay table as its replay: one line.

    python clients/sb3_dqn.py --seed 2                 # shmreplay.sb3.ReplayBuffer
    python clients/sb3_dqn.py --seed 2 --buffer sb3    # SB3's own ReplayBuffer, to compare

The line that changes, in a program that has SB3 already::

    model = DQN("MlpPolicy", env, replay_buffer_class=shmreplay.sb3.ReplayBuffer,
                replay_buffer_kwargs=dict(seed=2), ...)

(``seed`` seeds the private daemon's sampler, as ``DQN(seed=)`` seeds
SB3's; a shared table is ``replay_buffer_kwargs=dict(socket=PATH)``.)
The hyperparameters are rl-baselines3-zoo's for CartPole-v1 (lr 2.3e-3,
batch 64, 256 env steps then 128 gradient steps, target every 10 steps,
epsilon 1 to 0.04 over 16% of the run, a [256, 256] network); the run
takes up to ``--steps`` env steps (default 50,000).  SB3's own
``EvalCallback`` evaluates the greedy policy every ``--eval-every`` env
steps (default 5,000) over ``--eval-episodes`` (default 10), and
``StopTrainingOnRewardThreshold`` ends the run once that mean reaches
``--target-return`` (default 475), as an SB3 user would write it.  Once a
second it prints env steps/s, inserts/s, gradient steps/s and the mean
training return of the last 20 episodes (exploring: epsilon 0.04 at the
end); at the end one line::

    sb3_dqn: buffer shmreplay, CartPole-v1 seed 2, 25000 env steps in 33 s; greedy evaluation 500.0 (target 475): reached; <csv>, <png>

``sb3_dqn.csv`` and ``sb3_dqn.png`` (the learning curve against env
steps, the evaluations as points, the target line) go into ``--out`` (default: a run folder,
``runs/sb3_dqn-<env>-seed<N>-<time>``).  The greedy evaluation printed is
the best one.  Exit code 0: an evaluation reached ``--target-return``; 3:
none did within ``--steps``; 1: an error.  Needs the
examples and sb3 extras: ``pip install "shmreplay[examples,sb3]"``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import gymnasium as gym
from stable_baselines3 import DQN
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, EvalCallback, StopTrainingOnRewardThreshold
from stable_baselines3.common.monitor import Monitor

import shmreplay.sb3

import dqn  # clients/dqn.py: the progress report and the run folder


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--buffer", choices=["shmreplay", "sb3"], default="shmreplay")
    ap.add_argument("--env", default="CartPole-v1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--target-return", type=float, default=475.0)
    ap.add_argument("--eval-every", type=int, default=5000, help="env steps between greedy evaluations")
    ap.add_argument("--eval-episodes", type=int, default=10)
    ap.add_argument("--out", default=None,
                    help="the run folder for the CSV and PNG (default: runs/sb3_dqn-<env>-seed<N>-<time>)")
    return ap.parse_args(argv)


class Report(BaseCallback):
    """SB3's callback: episode returns (its Monitor's ``info["episode"]``)
    into the progress report, a line a second."""

    def __init__(self, progress: dqn.Progress, evaluate: EvalCallback):
        super().__init__()
        self.progress, self.evaluate, self.last = progress, evaluate, time.monotonic()

    def _on_step(self) -> bool:
        for info in self.locals["infos"]:
            if "episode" in info:
                self.progress.episode(info["episode"]["r"])
        ev = self.evaluate  # runs first (CallbackList's order): its evaluation of this step is in
        if ev.eval_freq > 0 and ev.n_calls % ev.eval_freq == 0:
            self.progress.evaluation(self.model.num_timesteps, ev.last_mean_reward)
        if time.monotonic() - self.last >= 1.0:
            self.tick()
        return True

    def tick(self) -> None:
        steps = self.model.num_timesteps
        self.progress.tick(steps, steps, self.model._n_updates)
        self.last = time.monotonic()


def main(argv=None) -> int:
    args = parse(argv)
    ours = args.buffer == "shmreplay"
    progress = dqn.Progress(dqn.run_dir(args, "sb3_dqn"), "sb3_dqn", title=dqn.title("sb3_dqn", args),
                            target=args.target_return)
    model = DQN("MlpPolicy", gym.make(args.env), seed=args.seed, learning_rate=2.3e-3, batch_size=64,
                buffer_size=100_000, learning_starts=1000, gamma=0.99, target_update_interval=10,
                train_freq=256, gradient_steps=128, exploration_fraction=0.16,
                exploration_final_eps=0.04, policy_kwargs=dict(net_arch=[256, 256]),
                # the one line: SB3's own buffer is the default (None)
                replay_buffer_class=shmreplay.sb3.ReplayBuffer if ours else None,
                replay_buffer_kwargs=dict(seed=args.seed) if ours else None)
    t0 = time.monotonic()
    evaluate = EvalCallback(Monitor(gym.make(args.env)), eval_freq=args.eval_every,
                            n_eval_episodes=args.eval_episodes, deterministic=True, verbose=0,
                            callback_on_new_best=StopTrainingOnRewardThreshold(args.target_return))
    report = Report(progress, evaluate)
    try:
        model.learn(args.steps, callback=CallbackList([evaluate, report]))
        report.tick()
        seconds = time.monotonic() - t0
        ret = evaluate.best_mean_reward  # -inf if it never evaluated
    finally:
        if ours:
            model.replay_buffer.close()  # stops the private daemon the buffer started
    csv_path, png = progress.save()
    reached = ret >= args.target_return
    print(f"sb3_dqn: buffer {args.buffer}, {args.env} seed {args.seed}, {model.num_timesteps} env steps "
          f"in {seconds:.0f} s; greedy evaluation {ret:.1f} (target {args.target_return:g}): "
          f"{'reached' if reached else 'not reached'}; {csv_path}, {png}", flush=True)
    return 0 if reached else 3


if __name__ == "__main__":
    sys.exit(main())
