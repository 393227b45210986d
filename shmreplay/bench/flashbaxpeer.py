"""Flashbax's prioritised item buffer (``make_prioritised_item_buffer``,
``add_batches=True``) on JAX CPU, under the Flashbax venv's python
(peerenv.py).  add, sample (with importance weights) and set_priorities are
jitted, add and set_priorities donating the buffer state as Flashbax's docs
advise; every call waits for its result (JAX dispatches asynchronously), and
a sample is copied out to numpy, so a batch is data in host memory like every
other peer's.  The single-item cell adds a batch of one.  No multiprocess
cell: the buffer state is a value passed from call to call in one process."""

from __future__ import annotations

import numpy as np

from .peers import BETA, new_priorities
from .workloads import Workload


class FlashbaxPeer:
    name = "flashbax"

    def open(self, w: Workload) -> None:
        import flashbax
        import jax
        import jax.numpy as jnp
        self.jax, self.w = jax, w
        self.rng = np.random.default_rng(1)
        buf = flashbax.make_prioritised_item_buffer(
            max_length=w.capacity, min_length=1, sample_batch_size=w.batch, add_batches=True,
            priority_exponent=0.6, device="cpu")
        example = {k: jnp.zeros(s, dtype=d) for k, (d, s) in w.fields.items()}
        # committed to the device and without weak types from the start, like
        # every later call's outputs: else the second call of each function
        # compiles it again
        cpu = jax.devices("cpu")[0]
        self.state = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), buf.init(example)), cpu)
        self.add = jax.jit(buf.add, donate_argnums=0)
        self.set_priorities = jax.jit(buf.set_priorities, donate_argnums=0)

        def sample(state, key, beta):
            key, sub = jax.random.split(key)
            s = buf.sample(state, sub)
            n = jnp.where(state.is_full, w.capacity, state.current_index)
            weights = (n * s.probabilities) ** -beta
            return key, s.experience, s.indices, weights / weights.max()
        self.sample = jax.jit(sample)
        self.key = jax.device_put(jax.random.PRNGKey(0), cpu)

    def insert(self, rows: dict, n: int) -> None:
        # numpy rows as the actors have them; n == 1 is a batch of one
        self.state = self.add(self.state, rows if len(next(iter(rows.values()))) == n
                              else {k: v[:n] for k, v in rows.items()})
        self.jax.block_until_ready(self.state)

    def settle(self) -> None:
        self.jax.block_until_ready(self.state)

    def size(self) -> int:
        return int(self.w.capacity if self.state.is_full else self.state.current_index)

    def sample_update(self, beta: float = BETA) -> dict:
        self.key, data, idx, weights = self.sample(self.state, self.key, beta)
        out = {k: np.asarray(v) for k, v in data.items()}
        out["weights"] = np.asarray(weights)
        prios = new_priorities(self.w.batch, self.rng).astype(np.float32)
        self.state = self.set_priorities(self.state, idx, prios)
        self.jax.block_until_ready(self.state)
        return out

    def close(self) -> None:
        self.state = None

    def mp_run(self, actors: int, chunk: int, seconds: float) -> dict:
        raise NotImplementedError("Flashbax has no multi-process mode")
