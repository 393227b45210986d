"""Who holds which table, and what each user other than the daemon's own
and root may still create.

The book keeps, for every table the daemon serves or is creating, the uid
that created it (the kernel's word on the connection: ``access.Peer``)
and its rows file's bytes if it is file-backed.  Tables the config
declares, and tables adopted or restored at start (whose creator this
daemon did not see), are the daemon's own user's, except a table another
user created: its definition names its creator (``creator_uid``).

A ``create_table`` of anyone but root and the daemon's user is refused
(``CapacityError`` naming the limit, before anything is made) when:

* the user holds ``max_tables_per_user`` tables;
* users other than the daemon's own and root hold ``max_tables`` less
  ``reserved_tables`` together: the rest is kept so the daemon's user and
  root can always create a table, whatever the others took;
* a file-backed table would take the user's rows-file bytes past their
  share of the storage filesystem, so no user's tables can fill it under
  another's durable table.  ``file_quota_bytes_per_user`` unset (the
  default share, the reservations' rule of docs/reliability.md section 8):
  on each filesystem, one user's rows files at most a quarter of its size,
  all other users' together at most half; set to N bytes: one user's rows
  files, on every filesystem together, at most N; 0: no share.  Root, the
  daemon's user and the admin group (``admin``) have no share.

Root and the daemon's user obey only ``max_tables``: they run the daemon
and chose its filesystem (a quota for them would be a quota on the
config's own tables).

Event-loop thread only (lifecycle.py claims at create, keeps at every table
brought up, releases at drop).
"""

from __future__ import annotations

import os

from ...errors import CapacityError, PermissionDenied
from ...wire.layout import TableLayout
from .access import is_owner


def rows_file_bytes(spec) -> int:
    """The bytes a table's rows file takes on disk (0: its rows are in /dev/shm)."""
    return TableLayout(spec).rows_size if spec.file_backed else 0


def filesystem(path: str) -> tuple[int, int]:
    """(device, size in bytes) of the filesystem ``path`` is or will be on
    (its nearest existing directory: a storage_dir is made at create)."""
    while True:
        try:
            st, vfs = os.stat(path), os.statvfs(path)
            return st.st_dev, vfs.f_blocks * vfs.f_frsize
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                raise
            path = parent
        except OSError as exc:
            raise PermissionDenied(f"storage_dir {path}: {exc.strerror}") from None


class TableBook:
    def __init__(self, cfg):
        self.cfg = cfg
        # table -> (creator uid, rows-file bytes, the rows' filesystem or None, exempt from shares)
        self.holders: dict[str, tuple[int, int, int | None, bool]] = {}

    def claim(self, spec, uid: int, admin: bool = False) -> None:
        """Book ``spec`` for ``uid`` (``admin``: of the admin group, which
        has no storage share) before it is made; raises the limit it would
        pass.  ``release`` it if the create fails."""
        fs = filesystem(spec.storage_dir) if spec.file_backed else None
        exempt = is_owner(uid) or admin
        if not is_owner(uid):
            self._check(spec, uid, fs, exempt)
        self.holders[spec.name] = (uid, rows_file_bytes(spec), fs and fs[0], exempt)

    def keep(self, spec) -> None:
        """A table brought up without a claim (the config's, adopted,
        restored): the daemon's own user's, unless its definition names its
        creator (``creator_uid``, or ``writer_uid`` of a board made before
        creators were kept: the kernel's word at its create), whose table
        it stays, counted against its limits and share as at the create
        (never refused here: it exists already)."""
        uid = next((u for u in (spec.creator_uid, spec.writer_uid) if u is not None), os.geteuid())
        fs = None
        if spec.file_backed and not is_owner(uid):
            try:
                fs = filesystem(spec.storage_dir)
            except (OSError, PermissionDenied):  # counted as on no filesystem: it is up already
                pass
        self.holders.setdefault(spec.name, (uid, rows_file_bytes(spec), fs and fs[0], is_owner(uid)))

    def release(self, name: str) -> None:
        self.holders.pop(name, None)

    def _check(self, spec, uid: int, fs, exempt: bool) -> None:
        cfg = self.cfg
        mine = [size for who, size, _, _ in self.holders.values() if who == uid]
        if len(mine) >= cfg.max_tables_per_user:
            raise CapacityError(
                f"user {uid} holds {len(mine)} tables, the limit per user (max_tables_per_user "
                f"{cfg.max_tables_per_user}); ask an admin to drop one you no longer need, or the "
                "operator to raise the limit")
        others = sum(not is_owner(who) for who, _, _, _ in self.holders.values())
        if others >= cfg.max_tables - cfg.reserved_tables:
            raise CapacityError(
                f"users other than the daemon's own and root hold {others} tables, all that "
                f"max_tables {cfg.max_tables} leaves them (reserved_tables {cfg.reserved_tables} are "
                "kept for the daemon's user and root); ask an admin to drop one, or the operator to "
                "raise max_tables")
        quota, used, size = cfg.file_quota_bytes_per_user, sum(mine), rows_file_bytes(spec)
        if quota is None and fs is not None and not exempt:
            self._share(spec, uid, fs, size)
        elif quota and size and used + size > quota and not exempt:
            raise CapacityError(
                f"table {spec.name!r}: its rows file takes {_size(size)}; user {uid}'s file-backed "
                f"tables take {_size(used)} of the quota of {_size(quota)} (file_quota_bytes_per_user "
                f"{quota}); make the table smaller, drop one of yours (an admin), put it in /dev/shm "
                "(storage_dir=\"\"), or ask the operator to raise the quota")

    def _share(self, spec, uid: int, fs: tuple[int, int], size: int) -> None:
        """The default share on the filesystem ``fs`` (device, size)."""
        dev, total = fs
        on = [(who, n) for who, n, d, ex in self.holders.values() if d == dev and not ex]
        mine, theirs = sum(n for who, n in on if who == uid), sum(n for _, n in on)
        for used, cap, whose, share in (
                (mine, total // 4, f"user {uid}'s file-backed tables there take", "a quarter of it per user"),
                (theirs, total // 2, "users other than root, the daemon's own and the admin group take "
                 "there, together,", "half of it for them all")):
            if used + size > cap:
                raise CapacityError(
                    f"table {spec.name!r}: its rows file takes {_size(size)}; {whose} {_size(used)} of "
                    f"their share of {_size(cap)} of the filesystem of {spec.storage_dir} ({_size(total)}: "
                    f"{share}, the default while file_quota_bytes_per_user is unset); make the table "
                    "smaller, drop one of yours (an admin), put it in /dev/shm (storage_dir=\"\"), or ask "
                    "the operator to set file_quota_bytes_per_user")

    def status(self) -> dict:
        """Per creator uid: its tables and their rows files' bytes."""
        out: dict = {}
        for who, size, _, _ in self.holders.values():
            mine = out.setdefault(str(who), {"tables": 0, "file_bytes": 0})
            mine["tables"] += 1
            mine["file_bytes"] += size
        return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
