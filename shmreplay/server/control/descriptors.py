"""The daemon's file descriptors: how many it may open, how many it holds,
and the reserve kept for root, its own user and the admin group.

Every client connection costs the daemon descriptors (its socket; from
``hello`` on its channel and two doorbells), and so does every table (its
segments; a file-backed table's read-ahead).  At
``RLIMIT_NOFILE`` the kernel refuses the next ``accept``: whoever connects
then is dropped without a word, the daemon's owner included.  So:

* ``raise_limit`` (daemon start) lifts the soft limit to the hard one;
* ``Descriptors`` counts what the daemon holds without listing
  ``/proc/self/fd`` on every connect: the descriptors of everything but
  connections (the *base*) are counted from ``/proc`` once at listen and
  again after each table is added or dropped (rare, and the only other
  lasting holders); each connection counts as the most it ever holds
  (``PER_CONNECTION``) until its lease has ended, and each refused
  connection that lingers as one;
* a connection of anyone but root, the daemon's user and the admin group
  that would leave fewer than ``reserved_descriptors`` free is refused
  (``gate.py``); so is another user's table (``lifecycle.py``).  The reserve
  also covers what the daemon opens for a moment (checkpoint and sync
  files, a table being built).

Event-loop thread only (``gate.py``, ``lifecycle.py``); ``raise_limit`` at startup.
"""

from __future__ import annotations

import logging
import os
import resource

from ...errors import CapacityError

log = logging.getLogger("shmreplayd.control")

# Python's mmap keeps a descriptor of its own for every mapping: a
# connection holds its socket, its channel's memfd until the hello reply
# carried it and the channel mapping's copy until the lease ends, and two
# doorbells
PER_CONNECTION = 5
# a table: its meta and rows segments (or rows file), each with its
# mapping's copy, and a file-backed table's read-ahead copy (disk/prefetch.py)
PER_TABLE = 5


def raise_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit (the kernel's
    ``nr_open`` where the hard limit is unlimited); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if want == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                want = int(f.read())
        except (OSError, ValueError):
            want = soft
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.info("descriptors: soft limit raised from %d to %d", soft, want)
            return want
        except (OSError, ValueError) as exc:
            log.warning("descriptors: cannot raise the soft limit %d to %d: %s", soft, want, exc)
    return soft


def count_open() -> int:
    """How many descriptors this process holds now (one /proc listing)."""
    return len(os.listdir("/proc/self/fd")) - 1  # the listing's own


class Descriptors:
    def __init__(self, limit: int, reserve: int):
        self.limit = limit
        self.reserve = reserve
        self.base = 0

    def recount(self, held: int) -> None:
        """Count the base again: what is open now less ``held``, what the
        connections and lingering refusals hold at this moment."""
        self.base = count_open() - held

    def in_use(self, connections: int, lingering: int) -> int:
        """What the daemon may hold at most, from the books (not /proc)."""
        return self.base + PER_CONNECTION * connections + lingering

    def fits(self, need: int, in_use: int) -> bool:
        """Do ``need`` more descriptors fit above the reserve?"""
        return in_use + need + self.reserve <= self.limit

    def refusal(self, need: int, in_use: int, what: str) -> CapacityError | None:
        """Why ``need`` more descriptors for another user's ``what`` would
        eat into the reserve, or None if they fit above it."""
        if self.fits(need, in_use):
            return None
        return CapacityError(
            f"the daemon holds {in_use} of its {self.limit} descriptors (RLIMIT_NOFILE) and keeps "
            f"the last {self.reserve} for root, its own user and the admin group "
            f"(reserved_descriptors {self.reserve}): no room for your {what}; try again when other "
            "clients have left, or ask the operator to raise LimitNOFILE")
