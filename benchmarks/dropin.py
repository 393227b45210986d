#!/usr/bin/env python3
"""The drop-in loop (issue 36, item 1): CleanRL's DQN on CartPole-v1 on an
in-process numpy ring buffer like stable-baselines3's, and on shmreplay
behind the same constructor, ``add`` and ``sample``, in one run.

    python3 benchmarks/dropin.py [--steps 100000] [--seeds 0,1,2] [--torch-threads N]
        [--buffers sb3,shmreplay,shmreplay_ahead] [--learner-spin-us US] [--out FILE]

The loop is CleanRL's ``dqn.py`` (the version on SB3's ``ReplayBuffer``):
one env, epsilon-greedy over a 4-120-84-2 MLP, every step one ``add`` of
one transition (obs and next_obs float32[4], action, reward, done); from
step 10,000 every 10th step a uniform ``sample(128)`` and one Adam update;
the target net copied every 500 steps; torch on the CPU with its default
threads unless ``--torch-threads``.  One plain ``gym.make`` env stepped by
hand instead of CleanRL's one-env ``SyncVectorEnv`` (less loop work around
the buffer, so its cost shows more, never less).

``SB3Buffer`` is written here as SB3's ``ReplayBuffer`` is (SB3 is not a
dependency): preallocated per-field arrays, ``np.random.randint`` indices,
rows copied out and copied again into tensors (``th.tensor``).
``SB3RoundTripBuffer`` (``--buffers sb3,sb3_roundtrip,shmreplay``) is
``SB3Buffer`` plus one round trip per sample to a helper process that
sleeps between samples: the loop's floor for any replay that lives in
another process, before it does any work.
``ShmreplayBuffer`` is what a user writes from the README: a private daemon
(``shmreplay.Server``) with one table of CleanRL's 10,000 items, ``insert``
per ``add``, ``sample`` then ``torch.from_numpy`` (a fresh batch is already
a copy).
``ShmreplayAheadBuffer`` (``shmreplay_ahead``) draws each batch ahead,
halfway between two samples (``sample(..., ahead=True)``), into the last
batch's arrays.
The environment reaches every run: ``GOMP_SPINCOUNT`` (how long torch's
OpenMP workers spin after an operation) or ``--torch-threads 1``, what
docs/guide.md advises on a box where the daemon shares the cores with
torch, apply to both buffers alike.

Each (buffer, seed) runs in its own process, the buffers in their order
for even seeds and reversed for odd ones.  Reported per buffer (medians over seeds):
env steps/s of the whole loop, the per-call cost of ``add`` and
``sample(128)`` (timed inside the loop, tensors included), CPU seconds of
the loop (the process's, plus the daemon's from /proc/<pid>/stat), and the
mean of the last 20 episode returns.  Writes JSON to
benchmarks/results/dropin-<time>.json.  Speed is reported, never asserted;
the box may be loaded, so compare only within one run.

On a loaded 2-core box torch's default threads (two OpenMP workers that
spin between operations) slow the in-process loop several-fold and more
than shmreplay's (2026-11-27, load ~5, seed 0: SB3's buffer 619 env steps/s
at 30,000 steps with the default threads, 2,848 at 15,000 with
``--torch-threads 1``; shmreplay ~1,600 both ways): say which was used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
from harness import results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPACITY = 10_000           # CleanRL's buffer_size
LEARNING_STARTS = 10_000
TRAIN_FREQUENCY = 10
BATCH = 128
TARGET_FREQUENCY = 500
GAMMA, LR = 0.99, 2.5e-4
START_E, END_E, EXPLORATION_FRACTION = 1.0, 0.05, 0.5


class Samples(NamedTuple):  # SB3's ReplayBufferSamples, as CleanRL reads it
    observations: object
    actions: object
    next_observations: object
    dones: object
    rewards: object


class SB3Buffer:
    """stable-baselines3's ``ReplayBuffer`` (one env, no memory optimization,
    no timeout handling), its semantics kept: arrays preallocated per field,
    ``add`` copies into ``pos``, ``sample`` draws ``randint(0, upper)`` and
    copies rows, then ``th.tensor`` copies them again."""

    def __init__(self, buffer_size: int, obs_shape: tuple):
        self.buffer_size = buffer_size
        self.observations = np.zeros((buffer_size, 1, *obs_shape), np.float32)
        self.next_observations = np.zeros((buffer_size, 1, *obs_shape), np.float32)
        self.actions = np.zeros((buffer_size, 1, 1), np.int64)
        self.rewards = np.zeros((buffer_size, 1), np.float32)
        self.dones = np.zeros((buffer_size, 1), np.float32)
        self.pos = 0
        self.full = False

    def add(self, obs, next_obs, action, reward, done) -> None:
        self.observations[self.pos] = np.array(obs)
        self.next_observations[self.pos] = np.array(next_obs)
        self.actions[self.pos] = np.array(action)
        self.rewards[self.pos] = np.array(reward)
        self.dones[self.pos] = np.array(done)
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
            self.pos = 0

    def sample(self, batch_size: int) -> Samples:
        import torch as th
        upper_bound = self.buffer_size if self.full else self.pos
        batch_inds = np.random.randint(0, upper_bound, size=batch_size)
        env_indices = np.random.randint(0, high=1, size=(len(batch_inds),))
        data = (self.observations[batch_inds, env_indices, :],
                self.actions[batch_inds, env_indices, :],
                self.next_observations[batch_inds, env_indices, :],
                self.dones[batch_inds, env_indices].reshape(-1, 1),
                self.rewards[batch_inds, env_indices].reshape(-1, 1))
        return Samples(*(th.tensor(a) for a in data))

    def close(self) -> None:
        pass

    def daemon_pid(self) -> int | None:
        return None


class SB3RoundTripBuffer(SB3Buffer):
    """The floor of any replay in another process: ``SB3Buffer``, plus per
    ``sample`` one round trip to a helper process that sleeps between
    samples, as the daemon does, and does nothing else (an eventfd each
    way, the reply awaited as shmreplay's client awaits it: a spin of up
    to 400 us, then a sleep).  What it costs over ``SB3Buffer`` is what
    the loop pays for crossing processes at all, before any replay work."""

    HELPER = ("import os, sys\n"
              "a, b = int(sys.argv[1]), int(sys.argv[2])\n"
              "while os.eventfd_read(a) < 2:\n"
              "    os.eventfd_write(b, 1)\n")

    def __init__(self, buffer_size: int, obs_shape: tuple):
        super().__init__(buffer_size, obs_shape)
        self.ask, self.reply = os.eventfd(0), os.eventfd(0, os.EFD_NONBLOCK)
        self.helper = subprocess.Popen([sys.executable, "-c", self.HELPER, str(self.ask), str(self.reply)],
                                       pass_fds=(self.ask, self.reply))

    def sample(self, batch_size: int) -> Samples:
        os.eventfd_write(self.ask, 1)
        spin_until = time.perf_counter() + 400e-6
        while True:
            try:
                os.eventfd_read(self.reply)
                break
            except BlockingIOError:
                if time.perf_counter() > spin_until:
                    select.select([self.reply], [], [], 10.0)
        return super().sample(batch_size)

    def close(self) -> None:
        os.eventfd_write(self.ask, 2)
        self.helper.wait(10)
        os.close(self.ask)
        os.close(self.reply)

    def daemon_pid(self) -> int | None:
        return self.helper.pid


class ShmreplayBuffer:
    """The same interface over a private shmreplay daemon (README: ``Server``,
    ``create_table``'s arguments, ``insert``, ``sample``)."""

    def __init__(self, buffer_size: int, obs_shape: tuple):
        import shmreplay
        fields = {"obs": ("float32", obs_shape), "next_obs": ("float32", obs_shape),
                  "action": ("int64", ()), "reward": ("float32", ()), "done": ("float32", ())}
        spin = os.environ.get("DROPIN_LEARNER_SPIN_US")  # --learner-spin-us, passed to the trials
        opts = {} if spin is None else {"learner_spin_us": float(spin)}
        self.server = shmreplay.Server(tables=[dict(name="replay", capacity=buffer_size, fields=fields)],
                                       **opts)
        self.table = self.server.connect().table("replay")

    def add(self, obs, next_obs, action, reward, done) -> None:
        self.table.insert(obs=obs, next_obs=next_obs, action=action, reward=reward, done=done)

    def sample(self, batch_size: int) -> Samples:
        import torch as th
        d = self.table.sample(batch_size).data
        return Samples(th.from_numpy(d["obs"]), th.from_numpy(d["action"]).unsqueeze(1),
                       th.from_numpy(d["next_obs"]), th.from_numpy(d["done"]).unsqueeze(1),
                       th.from_numpy(d["reward"]).unsqueeze(1))

    def close(self) -> None:
        self.server.stop()

    def daemon_pid(self) -> int | None:
        return self.server.pid


class ShmreplayPrefetchBuffer(ShmreplayBuffer):
    """The same over the README's learner loop: ``table.iterate(batch_size,
    prefetch=1)``, whose thread draws and gathers the next batch while the
    caller trains on this one (a batch is valid until the next ``sample``,
    which a DQN update respects)."""

    def sample(self, batch_size: int) -> Samples:
        import torch as th
        it = getattr(self, "batches", None)
        if it is None:
            it = self.batches = self.table.iterate(batch_size, prefetch=1)
        d = next(it).data
        return Samples(th.from_numpy(d["obs"]), th.from_numpy(d["action"]).unsqueeze(1),
                       th.from_numpy(d["next_obs"]), th.from_numpy(d["done"]).unsqueeze(1),
                       th.from_numpy(d["reward"]).unsqueeze(1))

    def close(self) -> None:
        if getattr(self, "batches", None) is not None:
            self.batches.close()
        super().close()


class ShmreplayAheadBuffer(ShmreplayBuffer):
    """The same with ``sample(batch_size, ahead=True, out=...)``: each batch
    is drawn in the daemon halfway between two samples (sent by ``insert``),
    while the loop steps the env, and gathered into the last batch's
    arrays (CleanRL's update is done with them by the next sample)."""

    last = None

    def sample(self, batch_size: int) -> Samples:
        import torch as th
        out = self.last if self.last is not None and len(self.last) == batch_size else None
        b = self.last = self.table.sample(batch_size, out=out, ahead=True)
        d = b.data
        return Samples(th.from_numpy(d["obs"]), th.from_numpy(d["action"]).unsqueeze(1),
                       th.from_numpy(d["next_obs"]), th.from_numpy(d["done"]).unsqueeze(1),
                       th.from_numpy(d["reward"]).unsqueeze(1))

BUFFERS = {"sb3": SB3Buffer, "sb3_roundtrip": SB3RoundTripBuffer, "shmreplay": ShmreplayBuffer,
           "shmreplay_prefetch": ShmreplayPrefetchBuffer,
           "shmreplay_ahead": ShmreplayAheadBuffer}


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def trial(buffer: str, seed: int, steps: int, threads: int | None) -> dict:
    """One run of the loop on one buffer (in its own process)."""
    import gymnasium as gym
    import torch
    import torch.nn.functional as F
    from torch import nn

    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1")
    env.action_space.seed(seed)
    n_actions = int(env.action_space.n)
    obs_shape = env.observation_space.shape

    def net():
        return nn.Sequential(nn.Linear(int(np.prod(obs_shape)), 120), nn.ReLU(),
                             nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, n_actions))

    q_network, target_network = net(), net()
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=LR)
    rb = BUFFERS[buffer](CAPACITY, obs_shape)
    add_ns = np.empty(steps, np.int64)
    sample_ns = []
    returns, ep_return = [], 0.0
    try:
        obs, _ = env.reset(seed=seed)
        dpid = rb.daemon_pid()
        cpu0, d0, t0 = self_cpu_s(), (proc_cpu_s(dpid) if dpid else 0.0), time.perf_counter()
        duration = EXPLORATION_FRACTION * steps
        for global_step in range(steps):
            epsilon = max(END_E, START_E + (END_E - START_E) * global_step / duration)
            if random.random() < epsilon:
                action = env.action_space.sample()
            else:
                with torch.no_grad():
                    action = int(torch.argmax(q_network(torch.as_tensor(obs)[None]), dim=1)[0])
            next_obs, reward, terminated, truncated, _ = env.step(action)
            ep_return += reward
            a = time.perf_counter_ns()
            rb.add(obs, next_obs, action, reward, terminated)
            add_ns[global_step] = time.perf_counter_ns() - a
            if terminated or truncated:
                returns.append(ep_return)
                ep_return = 0.0
                obs, _ = env.reset()
            else:
                obs = next_obs
            if global_step > LEARNING_STARTS:
                if global_step % TRAIN_FREQUENCY == 0:
                    a = time.perf_counter_ns()
                    data = rb.sample(BATCH)
                    sample_ns.append(time.perf_counter_ns() - a)
                    with torch.no_grad():
                        target_max, _ = target_network(data.next_observations).max(dim=1)
                        td_target = data.rewards.flatten() + GAMMA * target_max * (1 - data.dones.flatten())
                    old_val = q_network(data.observations).gather(1, data.actions).squeeze()
                    loss = F.mse_loss(td_target, old_val)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                if global_step % TARGET_FREQUENCY == 0:
                    target_network.load_state_dict(q_network.state_dict())
        wall = time.perf_counter() - t0
        cpu = self_cpu_s() - cpu0
        dcpu = (proc_cpu_s(dpid) - d0) if dpid else 0.0
    finally:
        rb.close()
        env.close()
    sample_ns = np.asarray(sample_ns, np.int64)
    return {"buffer": buffer, "seed": seed, "steps": steps, "torch_threads": torch.get_num_threads(),
            "wall_s": wall, "steps_per_s": steps / wall,
            "add_us_mean": float(add_ns.mean()) / 1e3, "add_us_median": float(np.median(add_ns)) / 1e3,
            "sample_us_mean": float(sample_ns.mean()) / 1e3 if sample_ns.size else None,
            "sample_us_median": float(np.median(sample_ns)) / 1e3 if sample_ns.size else None,
            "samples": int(sample_ns.size), "cpu_s": cpu, "daemon_cpu_s": dcpu, "total_cpu_s": cpu + dcpu,
            "episodes": len(returns), "last20_return": float(np.mean(returns[-20:])) if returns else None}


def run_trial(buffer: str, seed: int, a) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", buffer, "--seeds", str(seed),
           "--steps", str(a.steps)] + (["--torch-threads", str(a.torch_threads)] if a.torch_threads else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    if out.returncode != 0:
        return {"buffer": buffer, "seed": seed, "error": out.stderr.strip()[-800:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


ROWS = (("env steps/s", "steps_per_s", "{:,.0f}"), ("add us (mean)", "add_us_mean", "{:.1f}"),
        ("add us (median)", "add_us_median", "{:.1f}"), ("sample(128) us (mean)", "sample_us_mean", "{:.0f}"),
        ("sample(128) us (median)", "sample_us_median", "{:.0f}"), ("process CPU s", "cpu_s", "{:.1f}"),
        ("daemon CPU s", "daemon_cpu_s", "{:.1f}"), ("total CPU s", "total_cpu_s", "{:.1f}"),
        ("last-20 mean return", "last20_return", "{:.0f}"))


def table(runs: list, buffers: list) -> str:
    """Medians per buffer (each seed's in brackets), then each later
    buffer's ratio to the first."""
    ok = {b: [r for r in runs if r["buffer"] == b and "error" not in r] for b in buffers}
    base, others = buffers[0], buffers[1:]
    head = "| what | " + " | ".join(buffers) + "".join(f" | {b}/{base}" for b in others) + " |"
    lines = [head, "|---|" + "---:|" * (len(buffers) + len(others))]
    for label, key, fmt in ROWS:
        med = {b: statistics.median(v) if (v := [r[key] for r in ok[b] if r.get(key) is not None]) else None
               for b in buffers}
        cells = []
        for b in buffers:
            c = fmt.format(med[b]) if med[b] is not None else "-"
            if len(ok[b]) > 1 and med[b] is not None:
                c += " (" + ", ".join(fmt.format(r[key]) for r in ok[b] if r.get(key) is not None) + ")"
            cells.append(c)
        cells += [f"{med[b] / med[base]:.2f}x" if med[base] and med[b] is not None else "-" for b in others]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(runs: list, buffers: list) -> str:
    """Each later buffer's env steps/s over the first's, seed by seed: the
    two runs of a seed go back to back, so a VM whose speed drifts over the
    minutes of a run (this one's in-process loop moved by a fifth between
    runs) moves both; the median of these is the ratio to quote."""
    base = buffers[0]
    rate = {(r["buffer"], r["seed"]): r["steps_per_s"] for r in runs if "error" not in r}
    lines = []
    for b in buffers[1:]:
        ratios = [rate[(b, s)] / rate[(base, s)] for (bb, s) in rate if bb == base and (b, s) in rate]
        if ratios:
            lines.append(f"{b}/{base} env steps/s, seed by seed: median {statistics.median(ratios):.2f}x "
                         f"(" + ", ".join(f"{x:.2f}" for x in ratios) + ")")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000, help="env steps per run (training from 10,000)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--buffers", default="sb3,shmreplay,shmreplay_ahead")
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--learner-spin-us", type=float, help="the daemon's learner_spin_us (default: its own)")
    ap.add_argument("--timeout", type=float, default=1800, help="per run, seconds")
    ap.add_argument("--out", help="JSON file (default benchmarks/results/dropin-<time>.json)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: run one trial, print its JSON
    a = ap.parse_args(argv)
    if a.learner_spin_us is not None:
        os.environ["DROPIN_LEARNER_SPIN_US"] = str(a.learner_spin_us)
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.one:
        print(json.dumps(trial(a.one, seeds[0], a.steps, a.torch_threads)))
        return 0
    buffers = a.buffers.split(",")
    runs = []
    for i, seed in enumerate(seeds):
        for b in (buffers if i % 2 == 0 else buffers[::-1]):
            r = run_trial(b, seed, a)
            runs.append(r)
            print(f"  seed {seed} {b:<9} " + (r["error"].splitlines()[-1] if "error" in r else
                  f"{r['steps_per_s']:,.0f} steps/s  add {r['add_us_mean']:.1f} us  sample "
                  f"{r['sample_us_mean'] or 0:.0f} us  cpu {r['cpu_s']:.1f}+{r['daemon_cpu_s']:.1f} s  "
                  f"return {r['last20_return']}"), flush=True)
    load = os.getloadavg()
    print(f"\n{a.steps:,} env steps per run, seeds {a.seeds}, torch threads "
          f"{a.torch_threads or 'default'}, load average at the end {load[0]:.2f}; medians over seeds "
          f"(per seed in brackets)\n")
    print(table(runs, buffers))
    print("\n" + paired(runs, buffers))
    from shmreplay.bench import runner
    report = {"machine": runner.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": a.steps,
              "seeds": seeds, "torch_threads": a.torch_threads, "loadavg_end": load, "runs": runs}
    print(f"\nwrote {results.write(report, 'dropin', a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
