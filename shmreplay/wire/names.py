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
must trust lives there under a guessable name, and no default is a /tmp
name another user could take first.

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
import stat

from ..errors import ReplayError

ENV_SOCKET = "SHMREPLAY_SOCKET"
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path: sun_path is 108, with its NUL
SHM_DIR = "/dev/shm"
PREFIX = "shmreplay."


RUNTIME_HOME = (".cache", "shmreplay", "run")  # under the user's home, the last default
SOCKET_NAME = "shmreplay.sock"


def runtime_dir() -> str:
    """Where the instance lock and the default socket live, the same for
    every process of one user (so a daemon and its clients meet without
    configuration) and out of every other user's reach (anyone may create
    a name in /tmp first, so nothing here is a guessable /tmp name):

    1. systemd's ``$RUNTIME_DIRECTORY`` (the unit's RuntimeDirectory=);
    2. ``$XDG_RUNTIME_DIR/shmreplay``;
    3. /run/shmreplay for root;
    4. ``/run/user/<uid>/shmreplay`` when /run/user/<uid> is this user's
       own directory (a login session's, left when XDG_RUNTIME_DIR is not
       passed on);
    5. ``<home>/.cache/shmreplay/run`` (``$HOME``, else the password
       database's) when the home is this user's own directory.

    A candidate whose socket path would pass ``SOCKET_PATH_MAX`` is
    skipped.  With none left, ``ReplayError`` names what to set.  The
    daemon checks the directory before it puts anything there
    (``server/disk/safedir.py`` ``secure_dir``: every component a real
    directory of this user or root that no one else can write)."""
    d = os.environ.get("RUNTIME_DIRECTORY")
    if d:
        return d.split(":")[0]
    x = os.environ.get("XDG_RUNTIME_DIR")
    if x:
        return os.path.join(x, "shmreplay")
    uid = os.geteuid()
    if uid == 0:
        return "/run/shmreplay"
    tried = []
    for base, parts in ((f"/run/user/{uid}", ("shmreplay",)), (_home(), RUNTIME_HOME)):
        if not base:
            continue
        path = os.path.join(base, *parts)
        if not _own_dir(base, uid):
            tried.append(f"{base} (not a directory of uid {uid})")
        elif len(os.fsencode(os.path.join(path, SOCKET_NAME))) > SOCKET_PATH_MAX:
            tried.append(f"{path} (its socket path would pass {SOCKET_PATH_MAX} bytes)")
        else:
            return path
    raise ReplayError(f"no runtime directory for uid {uid}: tried {'; '.join(tried) or 'nothing'}; set "
                      "XDG_RUNTIME_DIR (or RUNTIME_DIRECTORY) to a directory only this user can write, "
                      f"or give the daemon and its clients a socket path (${ENV_SOCKET}) and the "
                      "daemon RUNTIME_DIRECTORY for its lock")


def _home() -> str:
    h = os.environ.get("HOME", "")
    if os.path.isabs(h):
        return h
    try:
        import pwd
        return pwd.getpwuid(os.geteuid()).pw_dir
    except (KeyError, ImportError):
        return ""


def _own_dir(path: str, uid: int) -> bool:
    """Is ``path`` a directory of ``uid`` (followed: a home may be a link;
    the daemon's ``secure_dir`` then decides whether it will use it)?"""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def default_socket_path() -> str:
    return os.path.join(runtime_dir(), SOCKET_NAME)


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
    """The creator's pid in an older build's channel, doorbell or inference
    segment (``shmreplay.inf.<pid>.<token>``, version 2) /dev/shm entry
    (0: none): nothing this build makes is named so."""
    base = name[4:] if name.startswith("sem.") else name
    try:
        return int(base.split(".")[2])
    except (IndexError, ValueError):
        return 0
