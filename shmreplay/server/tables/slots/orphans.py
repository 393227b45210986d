"""Slots a writer leased under a dead daemon: reused only once that writer
provably cannot write them any more.

A daemon that adopts a table finds slots RESERVED under the dead one.  Their
writer may be stalled between its epoch check and its copy (SIGSTOP, swap,
a long GC pause): whenever it resumes, its bytes land in those slots.  No
clock can say when that is over, so none decides.  The meta segment records
each reservation's holder (its pid and process start time, and the granting
daemon's pid with the client's id there), and a slot goes back to the free
list only when

* that process is gone (no process has that pid with that start time),
  checked at most every CHECK_S; or
* it reconnected and named its old lease (``hello``'s ``resume``): a client
  voids every lease before it reconnects, so it never copies into one again.

Until then the slots stay RESERVED in the meta segment too, so a daemon that
dies meanwhile hands them on to the next one unchanged.  A holder that never
reconnects and never exits (a client without ``reconnect`` that carries on
with other work) keeps them out of use until it exits; ``stats()`` shows
them.

Engine thread only (or before the table is served).
"""

from __future__ import annotations

import numpy as np

from ....wire.peer import process_alive

CHECK_S = 0.25  # how often the holders' liveness is read from /proc


class OrphanLeases:
    def __init__(self, slots: np.ndarray, pids: np.ndarray, starts: np.ndarray, owners: np.ndarray):
        # holder (pid, start, owner) -> its slots
        self.by_holder: dict[tuple[int, int, int], np.ndarray] = {}
        for key in {(int(p), int(s), int(o)) for p, s, o in zip(pids, starts, owners)}:
            mine = (pids == key[0]) & (starts == key[1]) & (owners == key[2])
            self.by_holder[key] = slots[mine]
        self.count = int(slots.shape[0])
        self.next_check = 0.0

    def gone(self, now: float) -> np.ndarray:
        """The slots of holders that have exited since the last look."""
        if not self.by_holder or now < self.next_check:
            return _NONE
        self.next_check = now + CHECK_S
        # a pid of 0 names no known process (a lease recorded by no client):
        # treated as alive, never freed by this path
        dead = [k for k in self.by_holder if k[0] and not process_alive(k[0], k[1])]
        return self._take(dead)

    def resumed(self, pid: int, start: int, owner: int) -> np.ndarray:
        """The slots of a holder that reconnected naming its old lease
        ``owner`` (``records.owner_key``); its pid and start come from
        the kernel (SO_PEERCRED), not from what it says."""
        return self._take([k for k in self.by_holder if k == (pid, start, owner)])

    def _take(self, keys: list) -> np.ndarray:
        if not keys:
            return _NONE
        out = np.concatenate([self.by_holder.pop(k) for k in keys])
        self.count -= int(out.shape[0])
        return out

    def holders(self) -> list[dict]:
        return [{"pid": k[0], "slots": int(v.shape[0])} for k, v in self.by_holder.items()]


_NONE = np.zeros(0, dtype=np.int64)
