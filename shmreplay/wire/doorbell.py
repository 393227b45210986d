"""Doorbells: one eventfd per direction of a client's channel, passed with
it (``channel.py``, "Sleeping"), and the engine's own.

A sleeping consumer waits on its eventfd; the producer rings it after it
publishes a record and finds the consumer's sleeping word set.  Each fd is
private to the daemon and that one client.  Any thread may ring; the
sleeper drains.
"""

from __future__ import annotations

import os


def new_doorbell() -> int:
    """Daemon: an eventfd, non-blocking, so a peer that filled its counter
    (writing 2**64-2) can only make its own wake-ups fail, never block us."""
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def ring(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:  # the counter is full: the other side has a wake-up pending anyway
        pass


def drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass
