"""A gymnasium vector env's streams, for a writer (``writers.py``): one
writer an env, made when the first batched step says how many envs there
are, each env's items committed in its own writer's order.

Gymnasium 1.x resets an env whose episode ended on its next ``step``
(``AutoresetMode.NEXT_STEP``, the default): that step's observation is the
reset one, its reward 0, and it is no transition (the action is ignored).
``autoreset="next_step"`` skips that step of that env; ``"disabled"``
counts every step (a program that resets its envs itself).  Gymnasium's
``SAME_STEP`` mode, whose reset observation replaces the final one in the
same step, is not taken: its transition's next observation is in
``infos["final_obs"]``.

Who calls it: its writer, on the writer's thread, one call at a time.
"""

from __future__ import annotations

import numpy as np

from ..errors import ReplayError

MODES = ("next_step", "disabled")


class EnvStreams:
    """One writer an env of a vector env (``make()`` makes one), and which
    envs' next step is gymnasium's autoreset."""

    def __init__(self, make, autoreset: str = "next_step"):
        if autoreset not in MODES:
            raise ReplayError(f"autoreset must be one of {MODES} (gymnasium's NEXT_STEP mode, or none), "
                              f"got {autoreset!r}")
        self._make = make
        self.autoreset = autoreset
        self.writers: list | None = None
        self._resetting: np.ndarray | None = None

    def counted(self, n: int, ended: np.ndarray) -> np.ndarray:
        """The envs (of ``n``) whose step this is a transition of; ``ended``:
        bool[n], their episodes ended at this step (terminated or truncated)."""
        if self.writers is None:
            self.writers = [self._make() for _ in range(n)]
            self._resetting = np.zeros(n, dtype=bool)
        elif len(self.writers) != n:
            raise ReplayError(f"a step of {n} envs to a writer of a vector env of {len(self.writers)}: "
                              "one writer a vector env")
        counted = np.flatnonzero(~self._resetting)
        # an env skipped now (its reset step) never ended in it: gymnasium says
        # terminated and truncated False there
        self._resetting = np.asarray(ended, dtype=bool) & (self.autoreset == "next_step")
        return counted

    def close(self, timeout: float | None = None) -> None:
        for w in self.writers or ():
            w.close(timeout)
