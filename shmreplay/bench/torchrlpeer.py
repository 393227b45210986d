"""TorchRL's TensorDictPrioritizedReplayBuffer over a LazyTensorStorage (its
in-memory storage), run under the peers venv's python (peerenv.py).  Batches
are TensorDicts built once from the same numpy rows (torch.from_numpy
shares them, so no copy is added).

Multiprocess cell: TorchRL's documented mode for writers in other
processes, ``shared=True, sync=False``: the storage, the writer's cursor
and its write count live in shared memory and the buffer itself is passed
to (spawned) actor processes, which ``extend`` it under the buffer's shared
write lock; those copies carry a uniform sampler, and the learner's own
prioritized sampler catches up from ``write_count`` (new items at the
default priority) before each sample."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from .peers import BETA, actor_loop, new_priorities, run_mp
from .workloads import Workload


class TorchrlPeer:
    name = "torchrl"

    def open(self, w: Workload, shared: bool = False) -> None:
        import torch
        from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
        torch.set_num_threads(1)  # one learner thread, like the other peers
        self.torch = torch
        self.w = w
        self.rng = np.random.default_rng(1)
        extra = {"shared": True, "sync": False} if shared else {}
        self.rb = TensorDictPrioritizedReplayBuffer(
            alpha=0.6, beta=BETA, storage=LazyTensorStorage(w.capacity), batch_size=w.batch, **extra)
        self.tds = {}

    def _td(self, rows: dict, n: int):
        key = (id(rows), n)
        if key not in self.tds:  # one item: the TensorDict of that item, not a batch of 1
            self.tds[key] = to_td(rows, n)[0] if n == 1 else to_td(rows, n)
        return self.tds[key]

    def insert(self, rows: dict, n: int) -> None:
        td = self._td(rows, n)
        if n == 1:
            self.rb.add(td)
        else:
            self.rb.extend(td)

    def settle(self) -> None:
        pass

    def size(self) -> int:
        return len(self.rb)

    def sample_update(self, beta: float = BETA) -> dict:
        s = self.rb.sample()
        self.rb.update_priority(s["index"], self.torch.from_numpy(new_priorities(self.w.batch, self.rng).astype(np.float32)))
        return s

    def close(self) -> None:
        self.rb = None
        self.tds = {}

    def mp_run(self, actors: int, chunk: int, seconds: float) -> dict:
        self.open(self.w, shared=True)  # the shared buffer replaces the local one
        # a storage is shared once it exists: one chunk from here allocates it
        # (in shared memory when the buffer is pickled for the actors)
        self.rb.extend(to_td(self.w.rows(chunk, seed=99), chunk))
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_actor, args=(self.rb, self.w.key, chunk, seconds, a, start, out))
                 for a in range(actors)]
        return run_mp(procs, start, out, seconds, self.sample_update, self.size)


def to_td(rows: dict, n: int):
    import torch
    from tensordict import TensorDict
    return TensorDict({k: torch.from_numpy(np.ascontiguousarray(v[:n])) for k, v in rows.items()},
                      batch_size=[n])


def _actor(rb, wkey, chunk, seconds, seed, start, out):
    import torch
    from .workloads import WORKLOADS
    torch.set_num_threads(1)
    td = to_td(WORKLOADS[wkey].rows(chunk, seed), chunk)
    actor_loop(lambda rows: rb.extend(td), wkey, chunk, seconds, seed, start, out)
