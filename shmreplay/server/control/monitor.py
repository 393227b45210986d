"""The daemon's view of itself over time: a snapshot of the engine's
numbers every ``interval`` seconds, the rates between the last two, and
the daemon's own memory and CPU.

``shmreplay status`` and ``top`` read rates from here (so a status needs
one round trip, not two a second apart), and the Prometheus endpoint
(``metrics.py``) pushes each new ``latest`` to its scrape process: the
snapshot is a new dict every time, handed over by one reference
assignment, never changed after, so a scrape never asks the engine
anything itself (a scrape costs the data path nothing).

Who calls it: the event loop runs ``run`` and reads ``latest``/``rates``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

log = logging.getLogger("shmreplayd")

INTERVAL_S = 1.0
_NEW = {"inserts": 0, "samples": 0, "sample_calls": 0}


def daemon_memory() -> dict:
    """This process's resident and peak resident memory, in bytes
    (/proc/self/status; zeros where it cannot be read)."""
    out = {"rss_bytes": 0, "peak_rss_bytes": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def daemon_cpu_s() -> float:
    """CPU seconds this process has used, all its threads, user and system."""
    t = os.times()
    return t.user + t.system


class Monitor:
    def __init__(self, call, snapshot, interval: float = INTERVAL_S):
        """``call(fn)``: run ``fn`` on the engine thread (``ControlServer.call``);
        ``snapshot``: the engine's ``snapshot``."""
        self.call, self.snapshot, self.interval = call, snapshot, interval
        self.latest: tuple[float, dict] | None = None    # (wall time, snapshot)
        self._prev: tuple[float, dict] | None = None     # (monotonic time, snapshot)
        self._last: tuple[float, dict] | None = None
        self.rates: dict = {}                            # table -> per-second rates
        self.cpu_percent = 0.0  # of one core, over the last interval

    async def run(self) -> None:
        while True:
            try:
                snap = await self.call(self.snapshot)
            except Exception:  # a failed look must not end the looking (the engine may be stopping)
                log.debug("monitor: engine snapshot failed", exc_info=True)
            else:
                snap["memory"] = daemon_memory()
                snap["cpu_s"] = daemon_cpu_s()
                self._prev, self._last = self._last, (time.monotonic(), snap)
                self.rates = self._rates()
                self.latest = (time.time(), snap)
            await asyncio.sleep(self.interval)

    def cpu(self) -> dict:
        """The daemon's CPU: seconds so far, and percent of one core over
        the last interval (what a user weighs against a learner's threads)."""
        return {"seconds": round(daemon_cpu_s(), 3), "percent": round(self.cpu_percent, 1)}

    def _rates(self) -> dict:
        if self._prev is None:
            return {}
        (t0, a), (t1, b) = self._prev, self._last
        dt = max(t1 - t0, 1e-9)
        self.cpu_percent = 100.0 * (b["cpu_s"] - a["cpu_s"]) / dt
        out = {}
        for name, now in b["tables"].items():
            was = a["tables"].get(name, _NEW)  # made since: counted from zero
            out[name] = {"inserts_per_s": (now["inserts"] - was["inserts"]) / dt,
                         "samples_per_s": (now["samples"] - was["samples"]) / dt,
                         "batches_per_s": (now["sample_calls"] - was["sample_calls"]) / dt,
                         "interval_s": dt}
        return out
