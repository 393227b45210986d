"""What the example programs share: environments, Q-networks, the Double-DQN
learner step, the Ape-X epsilon ladder, and the progress report (one line
a second, a CSV and a PNG learning curve at the end).

Not a program: ``apex_dqn.py`` and ``seed_learner.py`` import it as a plain
module (``import dqn``): Python puts a script's own folder first on
``sys.path``, so they run from any directory; their Ray workers get this
folder as their working directory.  Needs the examples
extra: ``pip install "shmreplay[examples]"`` (torch, gymnasium,
matplotlib); Atari ids also need ``shmreplay[atari]``.
"""

from __future__ import annotations

import collections
import csv
import os
import time

import numpy as np
import torch
from torch import nn

# Exit codes of apex_dqn.py and seed_learner.py: 0 --target-return reached;
# 1 an error (Python's own code for an uncaught exception, so a crash is never
# mistaken for a finished run); 2 the actors or env processes failed;
# NOT_REACHED: stopped at --max-minutes or --max-batches before the target.
NOT_REACHED = 3


# ---- environments ----
def make_env(env_id: str, seed: int):
    """A gymnasium env; Atari ids (``ALE/...``) get the standard DQN
    wrappers: 84x84 grayscale, frame skip 4, 4-frame stack, uint8."""
    import gymnasium as gym
    if env_id.startswith("ALE/"):
        import ale_py
        gym.register_envs(ale_py)
        env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
        env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True,
                                              noop_max=30, terminal_on_life_loss=False)
        env = gym.wrappers.FrameStackObservation(env, 4)
    else:
        env = gym.make(env_id)
    if not hasattr(env.action_space, "n"):
        raise SystemExit(f"{env_id}: DQN needs a discrete action space, this one is {env.action_space}")
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


def env_fields(env_id: str) -> tuple[dict, int]:
    """The replay table's fields for ``env_id`` and its number of actions."""
    env = make_env(env_id, 0)
    space = env.observation_space
    dtype = "uint8" if space.dtype == np.uint8 else "float32"
    shape = tuple(space.shape)
    env.close()
    fields = {"obs": (dtype, shape), "action": ("int64", ()), "reward": ("float32", ()),
              "discount": ("float32", ()), "next_obs": (dtype, shape)}
    return fields, int(env.action_space.n)


def epsilon_ladder(count: int, base: float = 0.4, alpha: float = 7.0) -> list[float]:
    """Ape-X's per-actor exploration: eps_i = base ** (1 + alpha * i / (count - 1))."""
    if count == 1:
        return [base]
    return [base ** (1 + alpha * i / (count - 1)) for i in range(count)]


# ---- networks ----
def q_network(obs_shape: tuple, actions: int) -> nn.Module:
    """An MLP for vector observations; the Nature-DQN CNN for 4x84x84 frames."""
    if len(obs_shape) == 3:
        c = obs_shape[0]
        return nn.Sequential(
            nn.Conv2d(c, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(),
            nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, actions))
    n = int(np.prod(obs_shape))
    return nn.Sequential(nn.Flatten(), nn.Linear(n, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, actions))


def as_input(obs: torch.Tensor) -> torch.Tensor:
    """Frames (uint8) scaled to [0, 1]; vectors as float32."""
    return obs.float().div_(255.0) if obs.dtype == torch.uint8 else obs.float()


class DoubleDQN:
    """The learner: Double DQN on n-step transitions with importance
    weights (prioritized replay), a target network synced every
    ``target_every`` updates, Huber loss, Adam, gradient clipping."""

    def __init__(self, obs_shape, actions, lr=5e-4, target_every=250, device="cpu"):
        self.device = torch.device(device)
        self.online = q_network(obs_shape, actions).to(self.device)
        self.target = q_network(obs_shape, actions).to(self.device)
        self.target.load_state_dict(self.online.state_dict())
        self.opt = torch.optim.Adam(self.online.parameters(), lr=lr)
        self.target_every, self.updates = target_every, 0

    def step(self, data: dict, weights: torch.Tensor) -> np.ndarray:
        """One update on a batch (tensors); returns |TD error| per row (the
        new priorities)."""
        obs, nxt = as_input(data["obs"]), as_input(data["next_obs"])
        action = data["action"].long()
        with torch.no_grad():
            best = self.online(nxt).argmax(1, keepdim=True)
            target = data["reward"] + data["discount"] * self.target(nxt).gather(1, best).squeeze(1)
        q = self.online(obs).gather(1, action.unsqueeze(1)).squeeze(1)
        td = target - q
        loss = (weights * nn.functional.smooth_l1_loss(q, target, reduction="none")).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.online.parameters(), 10.0)
        self.opt.step()
        self.updates += 1
        if self.updates % self.target_every == 0:
            self.target.load_state_dict(self.online.state_dict())
        return td.detach().abs().cpu().numpy()


def greedy(net: nn.Module, obs: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return net(as_input(torch.from_numpy(obs))).argmax(1).numpy()


def td_priority(net: nn.Module):
    """An actor-side initial priority for an n-step item (Ape-X): |TD
    error| under the actor's copy of the network."""
    def priority(item: dict) -> float:
        with torch.no_grad():
            both = as_input(torch.from_numpy(np.stack([item["obs"], item["next_obs"]])))
            q = net(both)
            target = float(item["reward"]) + float(item["discount"]) * float(q[1].max())
            return abs(target - float(q[0, int(item["action"])])) + 1e-3
    return priority


# ---- the programs' shared flags ----
def learner_flags(ap) -> None:
    """The flags both programs take (the environment, the stopping rules,
    the replay table, the Double-DQN learner, where results go)."""
    ap.add_argument("--env", default="CartPole-v1")
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
    ap.add_argument("--publish-every", type=int, default=25,
                    help="learner updates between weight hand-overs to the actors")
    ap.add_argument("--target-every", type=int, default=250)
    ap.add_argument("--device", default="cpu", help="the learner's torch device (cuda where there is one)")
    ap.add_argument("--out", default=None,
                    help="the run folder for the CSV and PNG (default: runs/<program>-<env>-seed<N>-<time> "
                         "under the current directory)")
    ap.add_argument("--instance", default=None, help="shared-memory name prefix of the private daemon")


# ---- progress ----
def run_dir(args, program: str) -> str:
    """Where a run's CSV and PNG go: ``--out``, else a folder of its own
    under ``runs/`` (``runs/`` is git-ignored: a run from the repository
    leaves nothing in it to commit)."""
    if args.out:
        return args.out
    env = args.env.replace("/", "-")
    return os.path.join("runs", f"{program}-{env}-seed{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")


def title(program: str, args) -> str:
    """A learning curve's title: the program, the env and the seed."""
    return f"{program}: {args.env}, seed {args.seed}"


COLUMNS = ["seconds", "env_steps", "inserts", "batches", "episodes", "recent_return"]  # docs/guide.md, "Example programs"


class Progress:
    """Once a second: env steps/s, inserts/s, batches/s, the recent return;
    at the end a CSV and a PNG learning curve under ``out_dir``."""

    def __init__(self, out_dir: str, name: str, window: int = 20, title: str | None = None,
                 target: float | None = None):
        """``title``: the curve's (the env and seed); ``target``: the return
        a run aims at, drawn as a line (None: none)."""
        self.out_dir, self.name = out_dir, name
        self.title, self.target = title or name, target
        os.makedirs(out_dir, exist_ok=True)
        self.returns: collections.deque = collections.deque(maxlen=window)
        self.episodes = 0
        self.rows: list[dict] = []
        self.evaluations: list[tuple[int, float]] = []  # (env steps, mean greedy return): points on the curve
        self.t0 = self.last_t = time.monotonic()
        self.last = (0, 0, 0)

    def episode(self, ret: float) -> None:
        self.returns.append(float(ret))
        self.episodes += 1

    def evaluation(self, env_steps: int, mean_return: float) -> None:
        """A greedy evaluation's mean return, drawn as a point on the curve."""
        self.evaluations.append((int(env_steps), float(mean_return)))

    @property
    def recent(self) -> float:
        """Mean return of the last ``window`` counted episodes (nan before the first)."""
        return float(np.mean(self.returns)) if self.returns else float("nan")

    def tick(self, env_steps: int, inserts: int, batches: int, extra: str = "") -> None:
        now = time.monotonic()
        dt = max(now - self.last_t, 1e-9)
        rates = [(a - b) / dt for a, b in zip((env_steps, inserts, batches), self.last)]
        row = dict(seconds=round(now - self.t0, 2), env_steps=env_steps, inserts=inserts, batches=batches,
                   episodes=self.episodes, recent_return=round(self.recent, 2))
        self.rows.append(row)
        print(f"[{row['seconds']:7.1f}s] env steps/s {rates[0]:7.0f}  inserts/s {rates[1]:7.0f}  "
              f"batches/s {rates[2]:6.1f}  episodes {self.episodes:5d}  recent return "
              f"{self.recent:6.1f}{extra}", flush=True)
        self.last_t, self.last = now, (env_steps, inserts, batches)

    def save(self) -> tuple[str, str]:
        """Write ``<name>.csv`` (one row per ``tick``, in order; columns
        ``COLUMNS``) and ``<name>.png``; returns their paths."""
        path = os.path.join(self.out_dir, self.name)
        with open(path + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(self.rows)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot([r["env_steps"] for r in self.rows], [r["recent_return"] for r in self.rows], label=self.name)
        if self.evaluations:
            ax.plot(*zip(*self.evaluations), "o", color="tab:green", markersize=4, label="greedy evaluation")
        if self.target is not None and np.isfinite(self.target):
            ax.axhline(self.target, color="tab:red", linestyle="--", linewidth=1, label=f"target {self.target:g}")
        ax.set_xlabel("env steps")
        ax.set_ylabel(f"mean return, last {self.returns.maxlen} episodes")
        ax.set_title(self.title)
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path + ".png")
        plt.close(fig)
        return path + ".csv", path + ".png"
