"""One Ape-X actor's loop, for apex_dqn.py's local actor processes and
apex_ray.py's Ray actors: ``len(eps)`` envs stepped together with their
own epsilons, an n-step writer each with actor-side priorities, weights
refreshed every ``--sync-every`` steps.  Its own file so that both
programs import it and neither imports the other.

Who calls it: one actor's thread.
"""

from __future__ import annotations

import numpy as np

import shmreplay

import dqn  # clients/dqn.py


def act(index: int, args, eps: list, steps, writer, latest, episode, stepped) -> None:
    """One actor's loop, local or on a Ray node: ``len(eps)`` envs stepped
    together, one n-step writer each (``writer(priority_fn)`` makes one);
    ``steps``: its ``shmreplay.actor_steps`` (the stop, the rate limiter's
    waits); ``latest(version)``: None or newer (version, weights);
    ``episode(eps, return)``, ``stepped(n)``: reports."""
    import torch
    import shmreplay.torch as srt
    torch.set_num_threads(1)
    fields, actions = dqn.env_fields(args.env)
    net = dqn.q_network(fields["obs"][1], actions)
    got = None
    while got is None:  # the learner publishes before it starts any actor
        got = latest(None)
    version, arrays = got
    srt.load_state(net, arrays)
    rng = np.random.default_rng([args.seed, index])
    envs = [dqn.make_env(args.env, args.seed * 1000 + index * 100 + i) for i in range(len(eps))]
    writers = [writer(dqn.td_priority(net)) for _ in envs]
    obs = np.stack([e.reset()[0] for e in envs])
    returns = np.zeros(len(envs))
    try:
        for _ in steps:
            if steps.local % args.sync_every == 0 and (got := latest(version)) is not None:
                version, arrays = got
                srt.load_state(net, arrays)
            a = dqn.greedy(net, obs)
            explore = rng.random(len(envs)) < eps
            a[explore] = rng.integers(actions, size=int(explore.sum()))
            for i, env in enumerate(envs):
                o2, r, term, trunc, _ = env.step(int(a[i]))
                steps.put(writers[i].append, obs=obs[i], action=a[i], reward=r, next_obs=o2,
                          terminated=term, truncated=trunc)
                returns[i] += r
                if term or trunc:
                    episode(eps[i], float(returns[i]))
                    returns[i] = 0.0
                    o2, _ = env.reset()
                obs[i] = o2
            stepped(len(envs))
    finally:
        for w in writers:
            w.close(**({"timeout": 5.0} if isinstance(w, shmreplay.NStepWriter) else {}))
