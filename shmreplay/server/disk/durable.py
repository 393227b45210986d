"""Durable metadata of a file-backed table: what lets a reboot find it.

A file-backed table keeps two files in its ``storage_dir``::

    shmreplay.<instance>.r.<table>   the rows (wire/rowfile.py), written by clients
    shmreplay.<instance>.t.<table>   the metadata as of the table's last sync: byte
                                     copies of the meta segment (same magic, layout
                                     version, header and schema; docs/layout.md),
                                     two of them, written in place alternately in
                                     space reserved when the table is made
                                     (``metafile.py``), mode 0600, by the daemon only

The meta segment in /dev/shm stays the live truth (a SIGKILLed daemon's
successor adopts it and loses nothing committed); the file is what is left
when /dev/shm is not: after a reboot, the next start copies it into a new
meta segment and adopts that (control/recovery.py), with every item committed
before the sync, bit-exact.

A sync of one table, in order:

1. engine thread (``take``): copy the meta segment; the reuse barrier
   (tables/slots/barrier.py) now also protects the items the copy lists;
2. executor (``write``): ``fdatasync`` the rows, so every row of every
   item in the copy is on disk; write the copy over the file's older copy,
   in place, and ``fdatasync`` (no new disk block: another user who filled
   the filesystem cannot stop it);
3. engine thread (``landed``): only the new file's items stay protected;
   slots retired before step 1 go back to the free list.

A sync runs every ``sync_interval_s``, when a full table is about to run
out of free slots (``Table.want_sync``), at every clean stop, and on
``shmreplay sync``; one at a time per table (the control plane's lock).
If step 2 fails (an I/O error) the newer copy stays whole, and so does the
wider protection: a half-written copy fails its checksum and is never read.
``reserve`` makes the file (or converts a format-1 file) when the table is
made or adopted, before it is served.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from ...errors import ForeignObject, LayoutError, ReplayError
from ...wire import headers, names
from ...wire.layout import TableMap, meta_mode
from ...wire.segment import Segment
from . import metafile, safedir

log = logging.getLogger("shmreplayd.durable")


def meta_file(tmap: TableMap) -> str:
    return os.path.join(tmap.spec.storage_dir,
                        names.storage_names(names.instance_of(tmap.name.lstrip("/")), tmap.spec.name)[0])


def temp_file(path: str) -> str:
    """Where ``reserve`` makes the file before its rename: a dot name,
    outside every table's names (a table may be called ``x.tmp``)."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.tmp")


def remove_stale(tmap: TableMap) -> None:
    """``durable_file_tables`` is off: a metadata file left from when it was
    on would no longer follow the rows, and a later start with it on would
    adopt it against rows rewritten since.  The live table is in /dev/shm."""
    path = meta_file(tmap)
    d, base = os.path.split(path)
    with safedir.opened(d, safedir.ROWS) as dfd:
        if safedir.entry(dfd, base) is not None and safedir.remove(dfd, base, d):
            log.warning("table %s: durable_file_tables is off; removed its metadata file %s, which "
                        "would no longer follow the rows", tmap.spec.name, path)


def remove_files(path: str) -> None:
    """A dropped table's metadata file and a sync's leftover temporary:
    removed if they are files of the daemon's user, relative to their
    checked directory (``safedir``); anything else is logged and left."""
    d, base = os.path.split(path)
    try:
        with safedir.opened(d, safedir.ROWS, missing_ok=True) as dfd:
            for name in (base, os.path.basename(temp_file(path))) if dfd is not None else ():
                safedir.remove(dfd, name, d)
    except ReplayError as exc:  # a drop goes on: the files stay, and say why
        log.error("metadata file %s left in place: %s", path, exc)


def reserve(path: str, meta_size: int, fresh: bool) -> int:
    """Executor, before a durable table is served (made, ``fresh``, or
    adopted): its metadata file with all its space reserved
    (``metafile.reserve``); returns the newest sync's sequence number in it
    (0: none)."""
    d, base = os.path.split(path)
    with safedir.opened(d, safedir.ROWS) as dfd:
        return metafile.reserve(dfd, base, path, meta_size, os.path.basename(temp_file(path)), fresh)


BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 60.0  # a failing sync is tried again this much later, doubling


class Durability:
    """A durable table's sync state.  ``want`` and ``trouble`` on the engine
    thread; the rest on the control plane's loop.

    A sync that fails (a full disk, an I/O error) backs off: the next one a
    full table asks for, or the periodic one, waits ``backoff_s``, which
    doubles with each failure up to BACKOFF_MAX_S (``retry_at``), so a
    failing disk costs one attempt and one log line per step, not one per
    insert.  An admin's ``shmreplay sync`` and a clean stop try at once."""

    def __init__(self, path: str, on_wanted):
        self.path = path
        self.on_wanted = on_wanted  # thread-safe: schedules a sync
        self.wanted = False
        self.syncs = self.failures = 0
        self.seq = 0            # the newest sync's number in the file (metafile.py)
        self.items = 0          # items in the file on disk
        self.last_ns = 0        # wall time of its copy
        self.seconds = 0.0      # how long the last sync took
        self.error: str | None = None  # why the last sync failed (None: it did not)
        self.backoff_s = 0.0
        self.retry_at = 0.0     # time.monotonic() before which no sync is started unasked

    def want(self) -> None:
        if not self.wanted:
            self.wanted = True
            self.on_wanted()

    def failed(self, why: str) -> float:
        """A sync failed: back off; returns the wait before the next."""
        self.failures += 1
        self.error = why
        self.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * self.backoff_s))
        self.retry_at = time.monotonic() + self.backoff_s
        return self.backoff_s

    def succeeded(self) -> None:
        self.error, self.backoff_s, self.retry_at = None, 0.0, 0.0

    def trouble(self) -> str:
        """For a writer that waits for slots: why the sync that frees them
        does not land ("" while syncs work)."""
        if self.error is None:
            return ""
        return (f"; the syncs of this table to {self.path} are failing ({self.error}); the next try "
                f"is in {max(0.0, self.retry_at - time.monotonic()):.1f} s: mend what the error names")

    def report(self) -> dict:
        """The sync's numbers (the table adds its reuse barrier's)."""
        return {"meta_file": self.path, "syncs": self.syncs, "sync_failures": self.failures,
                "synced_items": self.items,
                "last_sync_age_s": round((time.time_ns() - self.last_ns) / 1e9, 3) if self.last_ns else None,
                "last_sync_s": round(self.seconds, 4), "sync_error": self.error}


class Copy:
    """A meta segment's bytes as of one instant, and which items they list."""

    def __init__(self, size: int):
        self.buf = bytearray(size)
        self.listed: np.ndarray | None = None
        self.t_ns = 0
        self.items = 0


def take(table, copy: Copy) -> Copy:
    """Engine thread: step 1."""
    m = table.map
    copy.buf[:] = m.meta.buf
    copy.t_ns = time.time_ns()
    copy.listed = m.layout.committed_in(copy.buf)
    copy.items = int(np.count_nonzero(copy.listed))
    table.ledger.protect(copy.listed)
    table.durable.wanted = False
    return copy


def write(copy: Copy, rows_fd: int, path: str, seq: int) -> int:
    """Executor: step 2, as sync number ``seq``.  Returns the bytes written.
    Relative to the descriptor of the table's ``storage_dir``, checked as
    ``storage.py`` checks it (``safedir``), so no link is followed and
    nothing is written elsewhere; only into the mode-0600 file of the
    daemon's user that ``reserve`` made, in place."""
    os.fdatasync(rows_fd)
    d, base = os.path.split(path)
    with safedir.opened(d, safedir.ROWS) as dfd:
        metafile.write(dfd, base, path, copy.buf, seq)
    return len(copy.buf)


def landed(table, copy: Copy, seconds: float) -> int:
    """Engine thread: step 3.  Returns how many retired slots it freed."""
    freed = table.ledger.landed(copy.listed)
    d = table.durable
    d.syncs += 1
    d.items, d.last_ns, d.seconds = copy.items, copy.t_ns, seconds
    table.publish()
    return freed


# ---- startup: the files a reboot left ----

def read_file(path: str) -> bytes:
    """The meta bytes of the newest sync in a metadata file this daemon's
    user made (regular, mode 0600, opened without following a link, in a
    directory that passes ``safedir``'s checks; format 2, or format 1 as
    earlier builds wrote it); anything else is ``ForeignObject`` and is
    neither read nor touched, a file with no whole copy ``LayoutError``."""
    d, base = os.path.split(path)
    try:
        with safedir.opened(d, safedir.ROWS) as dfd:
            data = metafile.read(dfd, base, path)
    except ForeignObject:
        raise
    except (OSError, ReplayError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ForeignObject(f"metadata file {path} cannot be opened ({why}); left alone") from None
    return metafile.payload(data, path)


def files(instance: str, dirs) -> dict[str, str]:
    """table name -> metadata file, in the allowed storage directories.
    A name found in two directories (a table moved by a checkpoint and a
    restore) takes the newer file; the other is logged and left."""
    prefix = f"shmreplay.{instance}.t."
    found: dict[str, str] = {}
    for d in sorted(dirs):
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for e in entries:
            if not e.startswith(prefix):  # a sync's temporary file starts with a dot
                continue
            name, path = e[len(prefix):], os.path.join(d, e)
            old = found.get(name)
            if old is not None:
                newer = max((old, path), key=_mtime)
                log.warning("table %s: metadata files in two directories, %s and %s; using the "
                            "newer, %s", name, old, path, newer)
                path = newer
            found[name] = path
    return found


def _mtime(path: str) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:  # gone since the listing: the other one
        return -1


def to_segment(name: str, data: bytes, mode: int, gid: int) -> None:
    """Copy a metadata file's bytes into a new meta segment ``name`` for
    ``recovery.adopt``, which checks every byte of it as it checks a meta
    segment a dead daemon left."""
    if len(data) < headers.PAGE or headers.meta_header(data) is None:
        raise LayoutError(f"metadata file for {name} is not a shmreplay table")
    seg = Segment.create(name, len(data), 0o600, (-1, gid))
    try:
        seg.buf[:] = data
        # no owner: the copy is this daemon's (it holds the instance lock)
        h = headers.meta_header(seg.buf)
        headers.clear_owner(h)
        del h  # a view of the mapping: the close below needs none left
        seg.set_mode(meta_mode(mode), gid)
    except BaseException:
        seg.unlink()  # our copy; the file on disk stays
        raise
    finally:
        seg.close()


def listed_on_disk(tmap: TableMap, path: str) -> np.ndarray | None:
    """Which slots the metadata file of adopted table ``tmap`` lists as
    committed (those stay protected); None if there is no file, or it
    belongs to another incarnation of the table (then nothing is protected
    until the first sync, which follows at once)."""
    try:
        data = read_file(path)
    except LayoutError as exc:  # not ours (ForeignObject), or no whole copy in it
        if os.path.lexists(path):
            log.error("table %s: %s", tmap.spec.name, exc)
        return None
    listed = tmap.listed_in(data)
    if listed is None:
        log.warning("table %s: metadata file %s is not this table's; replaced at the next sync",
                    tmap.spec.name, path)
    return listed
