"""Startup of a daemon's tables: adopt what a dead daemon left, else restore
a checkpoint, else create.

Daemon startup only (step 5 in server/daemon.py), with the instance lock held, so
no live daemon can own any of the segments found (disk/ownership.py).

For each table segment of the instance in /dev/shm (a table survives its
daemon: SIGKILL, OOM kill, or a shutdown with ``retain_tables``):

* the segment must carry the magic, this build's layout version, a
  readable schema whose offsets match, and the size that schema implies
  (``layout.read_spec``);
* if the config declares a table of that name, the schema must be the
  same; a different one is an error, never a silent reformat;
* its owner (pid and start time in the header) must be dead;
* both segments must be regular files of the daemon's user with the modes
  it gives them, opened without following a symlink (anyone may create a
  name in /dev/shm first): a planted table is logged and left alone, and
  if the config names it the daemon does not start;

then the ``Table`` is rebuilt from it (``rebuild``): every committed item
stays, with its priority, times sampled and commit order; slots that were
held are freed, and slots that were reserved come back only once their
writer provably cannot write them (tables/slots/orphans.py).  Tables the config
declares that were not adopted are restored from the newest complete
checkpoint in the restore directory, and the rest are created empty.
Checkpointed tables that the config does not declare are restored too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time

import numpy as np

from ...errors import LayoutError, PermissionDenied, ReplayError
from ...wire import names
from ...wire.layout import TableMap
from ...wire.peer import process_alive, process_start
from ...wire import headers
from ...wire.rowfile import RowFile, rows_location, rows_name
from ...wire.segment import unlink_quiet
from ..disk import ckread, durable, ownership, storage
from ..tables.slots.ledger import SlotLimits
from ..tables.table import Table
from .memory import check_memory

log = logging.getLogger("shmreplayd.recovery")


def same_definition(spec, expected) -> bool:
    """``spec`` (found) is the table ``expected`` (the config's) declares,
    wherever its rows are (``storage_dir``) and however they lie
    (``row_layout``): neither is what a table is.  An adopted table keeps
    both; a restored one takes the config's."""
    return dataclasses.replace(spec, storage_dir=expected.storage_dir, row_layout=expected.row_layout) == expected


def adopt(name: str, mode: int, gid: int, declared=None, storage_dirs=frozenset()) -> TableMap:
    """Map a table's segments left by a dead daemon, after every check
    (``declared``: the config's tables by name, whose definition an adopted
    table of that name must have).  A file-backed table is adopted where its
    rows are (moving it is a checkpoint and a restore), if the config still
    allows that directory."""
    def check(spec):
        expected = (declared or {}).get(spec.name)
        if expected is not None and not same_definition(spec, expected):
            raise LayoutError(
                f"segment {name} holds table {spec.name!r} with another definition than the "
                f"config's ({spec} vs {expected}); restore the old definition, or checkpoint it "
                "with the old one and restore under the new")
        if spec.file_backed:
            if spec.storage_dir not in storage_dirs:
                raise LayoutError(f"table {spec.name!r} keeps its rows in {spec.storage_dir}, which "
                                  "the config no longer allows (storage_dir, storage_dirs); allow it "
                                  "again to adopt the table")
            storage.check_dir(spec.storage_dir)
        if expected is not None and spec.storage_dir != expected.storage_dir:
            log.warning("table %s: its rows are in %s, the config says %s; adopted where they are "
                        "(a checkpoint and a restore moves it)", spec.name,
                        spec.storage_dir or "/dev/shm", expected.storage_dir or "/dev/shm")

    tmap = TableMap.adopt(name, mode, gid, check)
    try:
        h = tmap.header
        pid, start = int(h["owner_pid"]), int(h["owner_start"])
        if pid != os.getpid() and process_alive(pid, start):
            raise ReplayError(f"segment {name} belongs to live process {pid}; not adopting it")
    except BaseException:
        tmap.release()
        raise
    return tmap


def rebuild(table_id: int, spec, tmap: TableMap, seed=None,
            limits: SlotLimits = SlotLimits()) -> Table:
    """A table rebuilt from a segment a dead daemon served (or a restored
    checkpoint): the committed items (state, priority, times sampled,
    commit number) are the truth; everything else is derived.  Slots a
    learner held under the dead daemon are freed; slots a writer had
    reserved stay out of use until that writer provably cannot write them
    (tables/slots/orphans.py).  Both get their stamps bumped, so no key a client kept
    for them matches.  Engine thread, or before the table is served."""
    t = Table(table_id, spec, tmap, seed, fresh=False, limits=limits)
    mts = spec.max_times_sampled
    held, leased = t.ledger.recover(mts)
    committed = t.selection.restore()
    if t.frames is not None:  # after the ledger: held slots it freed keep their references
        t.frames.adopt()
    m = tmap
    uses = int((mts - m.times[committed].astype(np.int64)).sum()) if mts else 0
    size = committed.shape[0]
    can_sample = (size >= spec.min_size_to_sample and t.selection.mass > 0
                  and (not mts or uses > 0))
    t.counters.restore(size, uses, can_sample)
    t.stats.update(recovered_items=size, recovered_orphans=held + leased)
    m.words.epoch = m.words.epoch + 1
    m.header["owner_pid"] = os.getpid()
    m.header["owner_start"] = process_start(os.getpid())
    t.publish()
    return t


def table_segments(instance: str) -> list[str]:
    """Every meta segment of ``instance`` in /dev/shm that is this user's own
    regular file (names: ``wire.names``).  Anything else named like one was
    planted: logged, never opened, never removed, and it blocks nothing."""
    prefix = names.table_prefix(instance)
    out = []
    for n in ownership.scan().get(instance, []):
        if not n.startswith(prefix):
            continue
        try:
            st = os.lstat(os.path.join(names.SHM_DIR, n))
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            out.append("/" + n)
        else:
            log.warning("/dev/shm/%s is named like a table of this instance but is not the "
                        "daemon's own file (uid %d); ignored", n, st.st_uid)
    return sorted(out)


def segments_from_disk(cfg) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """After a reboot (or anything else that emptied /dev/shm): copy the
    metadata file of each durable table in an allowed storage directory
    whose meta segment is gone into a new meta segment, for ``adopt``.
    Returns (segment name -> the file it was copied from, table name ->
    (why not, the file) for the files that could not be: not ours, not a
    table, a directory refused, no room in /dev/shm), never raising for one
    table's file."""
    have = {names.table_of_segment(seg) for seg in table_segments(cfg.instance)}
    out, failed = {}, {}
    for tname, path in durable.files(cfg.instance, cfg.storage_dirs).items():
        if tname in have:  # the segment is newer: a daemon was killed, the box was not rebooted
            continue
        seg = names.table_segment(cfg.instance, tname)
        try:
            storage.check_dir(os.path.dirname(path))
            durable.to_segment(seg, durable.read_file(path), cfg.segment_mode, cfg.gid)
        except (ReplayError, OSError) as exc:  # ForeignObject, LayoutError, ShmFull, a vanished file
            failed[tname] = (f"not adopted from its metadata file {path}: {exc}", path)
            continue
        out[seg] = path
    return out, failed


async def open_tables(srv, restore_dir: str | None) -> None:
    """Bring up every table (see the module docstring); srv is the
    ControlServer.  A table that fails any step is set aside (``setaside.py``),
    never allowed to stop the others."""
    cfg = srv.cfg
    declared = {spec.name: spec for spec in cfg.tables}
    from_disk, failed = (await srv.loop.run_in_executor(None, segments_from_disk, cfg)
                         if cfg.durable_file_tables else ({}, {}))
    for tname, (why, path) in failed.items():
        srv.tables.set_aside.add(tname, why, [path])
    for seg in await srv.loop.run_in_executor(None, table_segments, cfg.instance):
        await _adopt_one(srv, seg, declared, from_disk.get(seg))
    have = set(await srv.call(srv.engine.table_names))
    try:
        saved = ckread.complete(restore_dir) if restore_dir else {}
    except ReplayError as exc:  # e.g. a directory someone else could write: not read at all
        saved = {}
        for tname in declared:
            if tname not in have:
                srv.tables.set_aside.add(tname, f"the restore directory {restore_dir} was refused: {exc}")
    for tname in [n for n in declared if n not in have] + [n for n in saved if n not in declared]:
        if tname in have or tname in srv.tables.set_aside:
            continue  # served, or set aside: nothing is made over data that is kept
        try:
            if tname in saved:
                await restore_newest(srv, tname, saved[tname], declared.get(tname))
            else:
                await srv.tables.add(declared[tname])
        except Exception as exc:  # one table's: the others are served
            what = "restored" if tname in saved else "created"
            srv.tables.set_aside.add(tname, f"could not be {what}: {exc}", saved.get(tname, ()))


async def _adopt_one(srv, seg: str, declared: dict, from_file: str | None) -> None:
    """Adopt one meta segment (``from_file``: copied from that metadata file
    just now), or set its table aside."""
    cfg, t0 = srv.cfg, time.monotonic()
    tname = names.table_of_segment(seg)
    objects = _objects_of(seg) + ([from_file] if from_file else [])
    try:
        tmap = await srv.loop.run_in_executor(None, adopt, seg, cfg.segment_mode, cfg.gid,
                                              declared, cfg.storage_dirs)
    except Exception as exc:
        if from_file:  # our copy of the file, which stays as it is
            unlink_quiet(seg)
            objects = [from_file]
        srv.tables.set_aside.add(tname, f"{seg} could not be adopted: {exc}", objects)
        return
    tname = tmap.spec.name
    if tname in srv.tables.set_aside or await srv.call(srv.engine.describe, tname) is not None:
        # set aside under a name of its own (its segment's token), which keeps
        # the table of that name usable, and is what `shmreplay drop` takes
        tmap.release()
        rest = seg.lstrip("/").split(".", 3)[-1]
        key = rest if rest != tname else f"{tname}.old"
        srv.tables.set_aside.add(key, f"{seg} holds another copy of table {tname!r}, which is adopted "
                                      "or set aside already", objects)
        return
    try:
        table = await srv.tables.add(tmap.spec, tmap=tmap, recover=True)
    except Exception as exc:  # tables.add released the segments; they stay as they are
        srv.tables.set_aside.add(tname, f"{seg} was adopted but could not be served: {exc}", objects)
        return
    srv.tables.adopted.add(tname)
    log.info("table %s: adopted %s from %s: %d items (%.2f s)", tname, seg,
             "its metadata file" if from_file else "a dead daemon", table["items"],
             time.monotonic() - t0)


def _objects_of(seg: str) -> list[str]:
    """The paths that hold a meta segment's table: the segment and its rows
    (a segment, or a file where the schema inside says so)."""
    path = names.SHM_DIR + seg
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            spec = headers.stored_table(lambda off, n: os.pread(fd, n, off), path)[1]
        finally:
            os.close(fd)
        kind, where = rows_location(seg, spec)
        return [path, where if kind is RowFile else names.SHM_DIR + where]
    except Exception:  # unreadable: the rows segment its name implies
        return [path, names.SHM_DIR + rows_name(seg)]


async def restore_newest(srv, table: str, paths: list[str], expected) -> dict:
    """Restore the newest checkpoint that loads; a damaged one (any fault
    ``ckread.load`` finds) is logged and the one before it tried.  If
    none loads, the table is not started empty (that would hide the loss):
    the caller sets it aside with every checkpoint kept."""
    errors = []
    for path in reversed(paths):
        try:
            return await restore_table(srv, path, expected)
        except LayoutError as exc:
            log.error("checkpoint %s cannot be restored: %s", path, exc)
            errors.append(str(exc))
    raise LayoutError(f"no checkpoint of table {table!r} could be restored, so it is not started "
                      "empty (that would hide the loss); repair the checkpoints or move them "
                      "away: " + "; ".join(errors))


async def restore_table(srv, path: str, expected=None) -> dict:
    t0 = time.monotonic()
    ck = await srv.loop.run_in_executor(None, ckread.load, path)
    # where the rows go is the config's to say, not the checkpoint's: a
    # table moves between /dev/shm and disk by a checkpoint and a restore
    if expected is not None and not same_definition(ck.spec, expected):
        raise LayoutError(f"checkpoint {path} holds table {ck.spec.name!r} with another definition "
                          f"than the config's ({ck.spec} vs {expected})")
    spec = expected
    if spec is None:  # a client's table: where it was, if still allowed, else the default
        try:  # a stored None is /dev/shm ("" to place), not the default
            spec = srv.cfg.place(dataclasses.replace(ck.spec, storage_dir=ck.spec.storage_dir or ""))
        except PermissionDenied:
            spec = srv.cfg.place(dataclasses.replace(ck.spec, storage_dir=None))
    ck.spec = spec
    name = names.table_segment(srv.cfg.instance, spec.name)
    check_memory(spec)
    if spec.file_backed:
        await srv.loop.run_in_executor(None, storage.prepare_dir, spec.storage_dir, srv.cfg.gid)
    tmap = await srv.loop.run_in_executor(None, TableMap.create, name, spec, srv.cfg.gid)
    try:
        n = await srv.loop.run_in_executor(None, ckread.restore, ck, tmap)
    except BaseException:
        tmap.unlink()
        tmap.release()
        raise
    table = await srv.tables.add(spec, tmap=tmap, recover=True)
    log.info("table %s: restored %d items from %s (%.2f s)", ck.spec.name, n, path,
             time.monotonic() - t0)
    return table
