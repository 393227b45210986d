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

Event-loop thread only (the ``ControlServer`` owns one).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass, field

from ...errors import TableExists
from ...wire.rowfile import unlink_file_quiet

log = logging.getLogger("shmreplayd.recovery")


@dataclass
class AsideTable:
    name: str
    reason: str
    objects: list[str] = field(default_factory=list)  # absolute paths that hold its data
    since: float = field(default_factory=time.time)


class SetAside:
    def __init__(self):
        self.tables: dict[str, AsideTable] = {}

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
            self.tables[name] = AsideTable(name, reason, kept)
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
        """Forget ``name`` and remove its objects that are the daemon's own;
        returns the paths removed.  Anything else (another user's file, a
        link) is logged and left."""
        t = self.tables.pop(name)
        gone = []
        for path in t.objects:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                unlink_file_quiet(path)
                gone.append(path)
            else:
                log.warning("table %s: %s is not a regular file of the daemon's user; left", name, path)
        log.info("table %s (set aside) dropped: removed %s", name, ", ".join(gone) or "nothing")
        return gone

    def report(self) -> dict:
        return {t.name: {"reason": t.reason, "objects": t.objects, "since": t.since}
                for t in self.tables.values()}
