"""Tables set aside: ones the daemon found, or was told to serve, and cannot.

One bad table never stops the daemon.  At startup a table that cannot be
adopted (a segment that fails a check, a definition other than the
config's, a storage directory the config no longer allows or that is not
safe), restored (no checkpoint of it loads, the restore directory is
refused) or created (the config's table, when its storage is refused) is
set aside instead: logged once, listed in ``status`` with the reason and
the objects that hold its data, and left exactly as it is.  Every other
table is served.

A name set aside stays taken, so nothing is ever created over kept data:
a create of that name is refused with the reason.  The way out is the
operator's: fix the cause and restart the daemon (which tries again), or
drop the table (``shmreplay drop NAME``, an admin operation), which
removes the objects that are the daemon's own (regular files of its user,
never through a link) and nothing else.

Event-loop thread only (the tables' life cycle, lifecycle.py, owns one;
recovery.py adds to it at startup).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from dataclasses import dataclass, field

from ...errors import ReplayError, TableExists
from ...wire.names import SHM_DIR
from ..disk import safedir

log = logging.getLogger("shmreplayd.recovery")


@dataclass
class SetAsideTable:
    name: str
    reason: str
    objects: list[str] = field(default_factory=list)  # absolute paths that hold its data
    since: float = field(default_factory=time.time)


class SetAside:
    def __init__(self):
        self.tables: dict[str, SetAsideTable] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    def add(self, name: str, reason: str, objects=()) -> None:
        """Set ``name`` aside (again: the reasons add up)."""
        kept = [p for p in objects if os.path.lexists(p)]
        old = self.tables.get(name)
        if old is not None:
            old.reason += f"; {reason}"
            old.objects += [p for p in kept if p not in old.objects]
        else:
            self.tables[name] = SetAsideTable(name, reason, kept)
        log.error("table %s set aside, its data kept (%s): %s; every other table is served. Fix "
                  "the cause and restart the daemon, or `shmreplay drop %s` removes it",
                  name, ", ".join(kept) or "no objects", reason, name)

    def refuse(self, name: str) -> None:
        """Raise, naming the reason, if ``name`` is set aside."""
        t = self.tables.get(name)
        if t is not None:
            raise TableExists(
                f"table {name!r} is set aside, its data kept ({', '.join(t.objects) or 'no objects'}): "
                f"{t.reason}.  Fix the cause and restart the daemon to serve it, or drop it "
                f"(`shmreplay drop {name}`, admin) to remove it and use the name again")

    def drop(self, name: str) -> list[str]:
        """Forget ``name`` and remove its objects that are the daemon's own
        regular files, each relative to its directory's descriptor and never
        through a link (in a storage_dir once it passes safedir's checks);
        returns the paths removed.  Anything else (another user's file, a
        link, a checkpoint's directory) is logged and left."""
        t = self.tables.pop(name)
        gone = []
        for path in t.objects:
            where, base = os.path.split(path)
            try:
                with _directory(where) as dfd:
                    if dfd is None or safedir.entry(dfd, base) is None:
                        continue
                    if safedir.is_ours(safedir.entry(dfd, base), stat.S_ISREG) and \
                            safedir.remove(dfd, base, where):
                        gone.append(path)
                        continue
            except (ReplayError, OSError) as exc:  # its directory is not safe (any more)
                log.warning("table %s: %s left: %s", name, path, exc)
                continue
            log.warning("table %s: %s is not a regular file of the daemon's user; left", name, path)
        log.info("table %s (set aside) dropped: removed %s", name, ", ".join(gone) or "nothing")
        return gone

    def report(self) -> dict:
        return {t.name: {"reason": t.reason, "objects": t.objects, "since": t.since}
                for t in self.tables.values()}


@contextlib.contextmanager
def _directory(path: str):
    """A descriptor of the directory an object of a table lies in: /dev/shm
    (sticky: nobody else can swap an entry of ours), or a storage
    directory that passes safedir's checks (None if it is gone)."""
    if path == SHM_DIR:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)
    else:
        with safedir.opened(path, safedir.ROWS, missing_ok=True) as fd:
            yield fd

