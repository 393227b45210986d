"""The benchmark workloads of shared/WORKLOADS.md, exactly as defined there."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    key: str
    fields: dict          # name -> (dtype, shape)
    capacity: int
    batch: int

    @property
    def item_bytes(self) -> int:
        return sum(np.dtype(d).itemsize * int(np.prod(s)) for d, s in self.fields.values())

    def rows(self, n: int, seed: int = 0) -> dict:
        """n items of random content (generated once, reused by the loops)."""
        rng = np.random.default_rng(seed)
        out = {}
        for name, (dtype, shape) in self.fields.items():
            dt = np.dtype(dtype)
            if dt == np.bool_:
                out[name] = rng.random((n, *shape)) < 0.5
            elif dt.kind in "ui":
                out[name] = rng.integers(0, 256 if dt.itemsize == 1 else 18, size=(n, *shape), dtype=dt)
            else:
                out[name] = rng.standard_normal((n, *shape)).astype(dt)
        return out


WORKLOADS = {
    "sac-mujoco": Workload("sac-mujoco", {
        "obs": ("float32", (17,)), "action": ("float32", (6,)), "reward": ("float32", ()),
        "next_obs": ("float32", (17,)), "done": ("bool", ())}, 1_000_000, 256),
    "dqn-atari": Workload("dqn-atari", {
        "obs": ("uint8", (4, 84, 84)), "action": ("int32", ()), "reward": ("float32", ()),
        "done": ("bool", ())}, 100_000, 256),
    "r2d2-seq": Workload("r2d2-seq", {"obs": ("uint8", (80, 84, 84))}, 2_000, 64),
}
