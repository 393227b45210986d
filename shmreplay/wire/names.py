"""Names both sides agree on: the control socket's path and every shared object.

Every shared-memory object a daemon makes lives in /dev/shm under its
instance name::

    shmreplay.<instance>.t.<table>          a table's meta segment (kept across restarts)
    shmreplay.<instance>.r.<table>          its rows segment

Client channels and doorbells have no names: the daemon passes them to
their one client over the control socket (a sealed memfd and two
eventfds).  Names of the form ``shmreplay.<instance>.<pid>.c<n>`` and
``sem.shmreplay.<instance>.<pid>.*`` are older builds' channels and
doorbells, which a starting daemon or ``shmreplay cleanup`` removes.

The instance lock and the default socket live in the user's runtime
directory (``runtime_dir()``), which only that user (or root) can write
(the daemon checks every component of its path, ``server/disk/safedir.py``):
anyone may create a name in /dev/shm or /tmp first, so nothing the daemon
must trust lives there under a guessable name.

    <runtime dir>/shmreplay.<instance>.lock  the instance lock (server/disk/ownership.py)
    <runtime dir>/shmreplay.sock             the default control socket

Socket path: a daemon takes ``--socket``, its config's ``daemon.socket``,
``$SHMREPLAY_SOCKET``, then ``default_socket_path()``; a client takes its
``path`` argument, ``$SHMREPLAY_SOCKET``, then the same default, so a daemon
and a client of one user started with no configuration always meet.

Pure functions; any thread.
"""

from __future__ import annotations

import os

ENV_SOCKET = "SHMREPLAY_SOCKET"
SHM_DIR = "/dev/shm"
PREFIX = "shmreplay."


def runtime_dir() -> str:
    """systemd's ``$RUNTIME_DIRECTORY`` (the unit's RuntimeDirectory=), else
    ``$XDG_RUNTIME_DIR/shmreplay``, else /run/shmreplay for root, else
    /tmp/shmreplay-<uid>.  The daemon checks it before it puts anything there
    (``server/disk/safedir.py`` ``secure_dir``: every component a real
    directory of this user or root that no one else can write)."""
    d = os.environ.get("RUNTIME_DIRECTORY")
    if d:
        return d.split(":")[0]
    x = os.environ.get("XDG_RUNTIME_DIR")
    if x:
        return os.path.join(x, "shmreplay")
    return "/run/shmreplay" if os.geteuid() == 0 else f"/tmp/shmreplay-{os.getuid()}"


def default_socket_path() -> str:
    return os.path.join(runtime_dir(), "shmreplay.sock")


def client_socket_path(path: str | None = None) -> str:
    return path or os.environ.get(ENV_SOCKET) or default_socket_path()


def table_segment(instance: str, table: str) -> str:
    """Stable per instance, so a restarted daemon finds its tables."""
    return f"/{PREFIX}{instance}.t.{table}"


def lock_path(instance: str) -> str:
    return os.path.join(runtime_dir(), f"{PREFIX}{instance}.lock")


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
