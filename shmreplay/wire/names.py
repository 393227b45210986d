"""Names both sides agree on: the control socket's path and every shared object.

Every shared-memory object a daemon makes lives in /dev/shm under its
instance name::

    shmreplay.<instance>.t.<table>.<token>  a table's meta segment (kept across restarts)
    shmreplay.<instance>.r.<table>.<token>  its rows segment

The token is 16 random hex digits, new for every table the daemon makes
(creates, restores, copies from disk): anyone may create a name in
/dev/shm, and a name nobody can guess is one nobody can take first.  A
restarted daemon finds its tables by listing the prefix and keeping only
its own regular files, and takes each table's name from the schema inside,
never from the object's name (so names earlier builds made without a token
are adopted too).  Clients learn a table's segment name from the daemon.
A file-backed table's two files in its ``storage_dir`` keep stable names
(``storage_names``): only the daemon's user can write that directory, and a
reboot must find them.

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
import re
import secrets

ENV_SOCKET = "SHMREPLAY_SOCKET"
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path: sun_path is 108, with its NUL
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


def table_segment(instance: str, table: str, token: str | None = None) -> str:
    """A new meta segment name for ``table`` (a fresh token unless given)."""
    return f"/{PREFIX}{instance}.t.{table}.{token or secrets.token_hex(8)}"


def table_prefix(instance: str) -> str:
    """What every meta segment name of ``instance`` starts with (in /dev/shm, no slash)."""
    return f"{PREFIX}{instance}.t."


def storage_names(instance: str, table: str) -> tuple[str, str]:
    """The names of a file-backed table's metadata file and rows file in its
    ``storage_dir`` (server/disk/durable.py, wire/rowfile.py)."""
    return f"{PREFIX}{instance}.t.{table}", f"{PREFIX}{instance}.r.{table}"


_TOKEN = re.compile(r"\.[0-9a-f]{16}$")


def table_of_segment(name: str) -> str:
    """The table name a meta segment's name carries (a hint for logs and
    for matching metadata files: the schema inside is the truth)."""
    rest = name.lstrip("/").split(".", 3)[-1]
    return _TOKEN.sub("", rest)


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
