"""Who holds which table, and what each user other than the daemon's own
and root may still create.

The book keeps, for every table the daemon serves or is creating, the uid
that created it (the kernel's word on the connection: ``access.Peer``)
and its rows file's bytes if it is file-backed.  Tables the config
declares, and tables adopted or restored at start (whose creator this
daemon did not see), are the daemon's own user's.

A ``create_table`` of anyone but root and the daemon's user is refused
(``CapacityError`` naming the limit, before anything is made) when:

* the user holds ``max_tables_per_user`` tables;
* users other than the daemon's own and root hold ``max_tables`` less
  ``reserved_tables`` together: the rest is kept so the daemon's user and
  root can always create a table, whatever the others took;
* a file-backed table would take the user's rows-file bytes past
  ``file_quota_bytes_per_user`` (0: no quota), so one user's tables cannot
  fill the storage filesystem under another's durable table.

Root and the daemon's user obey only ``max_tables``: they run the daemon
and chose its filesystem (a quota for them would be a quota on the
config's own tables).

Event-loop thread only (server.py claims at create, keeps at every table
brought up, releases at drop).
"""

from __future__ import annotations

import os

from ...errors import CapacityError
from ...wire.layout import TableLayout
from .access import is_owner


def rows_file_bytes(spec) -> int:
    """The bytes a table's rows file takes on disk (0: its rows are in /dev/shm)."""
    return TableLayout(spec).rows_size if spec.file_backed else 0


class TableBook:
    def __init__(self, cfg):
        self.cfg = cfg
        self.holders: dict[str, tuple[int, int]] = {}  # table -> (creator uid, rows-file bytes)

    def claim(self, spec, uid: int) -> None:
        """Book ``spec`` for ``uid`` before it is made; raises the limit it
        would pass.  ``release`` it if the create fails."""
        if not is_owner(uid):
            self._check(spec, uid)
        self.holders[spec.name] = (uid, rows_file_bytes(spec))

    def keep(self, spec) -> None:
        """A table brought up without a claim (the config's, adopted,
        restored): the daemon's own user's."""
        self.holders.setdefault(spec.name, (os.geteuid(), rows_file_bytes(spec)))

    def release(self, name: str) -> None:
        self.holders.pop(name, None)

    def _check(self, spec, uid: int) -> None:
        cfg = self.cfg
        mine = [size for who, size in self.holders.values() if who == uid]
        if len(mine) >= cfg.max_tables_per_user:
            raise CapacityError(
                f"user {uid} holds {len(mine)} tables, the limit per user (max_tables_per_user "
                f"{cfg.max_tables_per_user}); ask an admin to drop one you no longer need, or the "
                "operator to raise the limit")
        others = sum(not is_owner(who) for who, _ in self.holders.values())
        if others >= cfg.max_tables - cfg.reserved_tables:
            raise CapacityError(
                f"users other than the daemon's own and root hold {others} tables, all that "
                f"max_tables {cfg.max_tables} leaves them (reserved_tables {cfg.reserved_tables} are "
                "kept for the daemon's user and root); ask an admin to drop one, or the operator to "
                "raise max_tables")
        quota, used, size = cfg.file_quota_bytes_per_user, sum(mine), rows_file_bytes(spec)
        if quota and size and used + size > quota:
            raise CapacityError(
                f"table {spec.name!r}: its rows file takes {_size(size)}; user {uid}'s file-backed "
                f"tables take {_size(used)} of the quota of {_size(quota)} (file_quota_bytes_per_user "
                f"{quota}); make the table smaller, drop one of yours (an admin), put it in /dev/shm "
                "(storage_dir=\"\"), or ask the operator to raise the quota")

    def status(self) -> dict:
        """Per creator uid: its tables and their rows files' bytes."""
        out: dict = {}
        for who, size in self.holders.values():
            mine = out.setdefault(str(who), {"tables": 0, "file_bytes": 0})
            mine["tables"] += 1
            mine["file_bytes"] += size
        return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
