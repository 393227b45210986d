"""Names both sides agree on: the control socket's path and every shared object.

Every object a daemon makes lives in /dev/shm under its instance name::

    shmreplay.<instance>.lock               the instance lock (server/ownership.py)
    shmreplay.<instance>.t.<table>          a table's meta segment (kept across restarts)
    shmreplay.<instance>.r.<table>          its rows segment
    shmreplay.<instance>.<pid>.c<n>         a client channel (unlinked once attached)
    sem.shmreplay.<instance>.<pid>.c<n>.s   its semaphore
    sem.shmreplay.<instance>.<pid>.bell     the daemon's doorbell

Socket path: a daemon takes ``--socket``, its config's ``daemon.socket``,
``$SHMREPLAY_SOCKET``, then ``default_socket_path()``; a client takes its
``path`` argument, ``$SHMREPLAY_SOCKET``, then the same default, so a daemon
and a client started with no configuration always meet.

Pure functions; any thread.
"""

from __future__ import annotations

import os

ENV_SOCKET = "SHMREPLAY_SOCKET"
SHM_DIR = "/dev/shm"
PREFIX = "shmreplay."


def default_socket_path() -> str:
    return f"/tmp/shmreplay-{os.getuid()}.sock"


def client_socket_path(path: str | None = None) -> str:
    return path or os.environ.get(ENV_SOCKET) or default_socket_path()


def table_segment(instance: str, table: str) -> str:
    """Stable per instance, so a restarted daemon finds its tables."""
    return f"/{PREFIX}{instance}.t.{table}"


def channel_segment(instance: str, daemon_pid: int, client: int) -> str:
    return f"/{PREFIX}{instance}.{daemon_pid}.c{client}"


def channel_semaphore(channel: str) -> str:
    return channel + ".s"


def doorbell(instance: str, daemon_pid: int) -> str:
    return f"/{PREFIX}{instance}.{daemon_pid}.bell"


def lock_path(instance: str) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{instance}.lock")


def instance_of(name: str) -> str | None:
    """The instance an entry of /dev/shm belongs to, or None if not ours."""
    if name.startswith("sem."):
        name = name[4:]
    if not name.startswith(PREFIX):
        return None
    parts = name.split(".")
    return parts[1] if len(parts) >= 3 and parts[1] else None


def is_table(name: str) -> bool:
    """Is this /dev/shm entry a table segment?"""
    return not name.startswith("sem.") and (".t." in name or ".r." in name)


def pid_in_name(name: str) -> int:
    """The daemon pid in a channel's or doorbell's /dev/shm entry (0: none)."""
    base = name[4:] if name.startswith("sem.") else name
    try:
        return int(base.split(".")[2])
    except (IndexError, ValueError):
        return 0
