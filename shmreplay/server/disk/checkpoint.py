"""Table checkpoints: a consistent copy on disk while inserts and samples go on.

A checkpoint of table ``T`` is a directory ``DIR/T@<UTC time>/``::

    meta.msgpack    format name and version, layout version, the table's
                    spec, its limiter counters, and for each array file its
                    dtype, shape and CRC-32
    slots.bin       int64[n]   slot of each item
    gens.bin        uint32[capacity]  every slot's generation stamp
    prios.bin       float64[n], times.bin uint32[n], seqno.bin uint64[n]
    valid.bin       uint8[n]   0: the item was evicted while the rows were
                    copied, so its rows may be torn; restore skips it
    f.<field>.bin   dtype[n, *shape]  each field's rows (a frame table's:
                    each field a slot holds; its stacks are
                    refs.bin, frameidx.<base>.bin and frames.<base>.bin,
                    ckframes.py)
    DONE            written last: a directory without it is incomplete

Writing (who: the control plane, in an executor thread; the only engine
time is ``snapshot``):

1. ``snapshot`` runs on the engine thread: it copies the per-slot metadata
   arrays and the counters.  That copy, 21 bytes a slot and no row data, is
   the only pause inserts and samples see.
2. ``write`` copies the rows of those items while writers go on, a chunk
   at a time and oldest first, and re-reads each chunk's generation stamps
   right after gathering it: a slot whose stamp moved was reserved by a
   writer since the snapshot, so its row may be torn and it is marked
   invalid (the same check a learner makes after a gather).
3. Every file is written into ``DIR/.T@<time>.tmp<pid>``, fsynced, DONE
   last, the directory fsynced and renamed into place, and DIR fsynced:
   a crash at any point leaves either the old checkpoints or the new one.
   DIR must pass ``safedir``'s checks (it is made if missing), and all of
   this happens relative to directory descriptors: files are made
   ``O_CREAT|O_EXCL|O_NOFOLLOW`` and given the table's meta segment's mode
   (0640) and the config's group, directories that plus search (0750),
   and nothing is removed but the daemon user's own files and directories
   (``safedir.remove``), never through a link.

The checkpoint is the table as the snapshot saw it, minus items evicted
before their rows were copied.  Restoring (``restore``) writes the items back into the
same slots with the same stamps, so the round trip is bit-exact and keys a
learner holds stay valid; the table then starts through the same recovery
path as a table adopted after a crash (``recovery.rebuild``).  Listing,
loading and restoring are ckread.py's (re-exported here).

Who calls: the control plane (control/server.py), ``snapshot`` through the
engine, the rest in executor threads; startup (control/recovery.py).
"""

from __future__ import annotations

import collections
import os
import time
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from ...schema import TableSpec
from ...framespec import slot_fields
from ...wire.headers import layout_version
from ...wire.layout import COMMITTED, meta_mode
from . import ckframes, safedir
from .sealed import SealedFile, write_file
from .ckread import CHUNK_BYTES, FORMAT, FORMAT_VERSION, complete_in
from .rowread import RowSource


@dataclass
class Snapshot:
    spec: TableSpec
    state: np.ndarray   # copies of the whole per-slot arrays, taken at once
    gens: np.ndarray
    prios: np.ndarray
    times: np.ndarray
    seqno: np.ndarray
    counters: dict
    pause_s: float
    rows: RowSource        # the live rows and stamps, kept open while
    live_gens: np.ndarray  # written even if the table is dropped meanwhile
    refs: np.ndarray | None = None  # a frame table's items' references (ckframes.py)


_META = (("state", np.uint8), ("gens", np.uint32), ("prios", np.float64), ("times", np.uint32),
         ("seqno", np.uint64))


def buffers(capacity: int) -> dict:
    """Any thread: arrays for a snapshot, with every page already faulted
    in, so the engine's copy into them is a plain memcpy (into fresh
    memory it would pay a page fault per 4 KiB: 18 ms instead of ~3 ms for
    a million slots)."""
    return {name: np.ones(capacity, dtype) for name, dtype in _META}


def snapshot(table, bufs: dict) -> Snapshot:
    """Engine thread only: copy the per-slot metadata (21 bytes a slot) into
    ``bufs`` and read the counters.  Picking the committed items out of the
    copies happens in ``write``, off the engine thread."""
    t0 = time.perf_counter()
    m, c = table.map, table.counters
    for name, _ in _META:
        np.copyto(bufs[name], getattr(m, name))
    snap = Snapshot(table.spec, bufs["state"], bufs["gens"], bufs["prios"], bufs["times"],
                    bufs["seqno"],
                    {"inserts": c.inserts, "samples": c.samples, "deletes": c.deletes,
                     "epoch": m.words.epoch}, 0.0, RowSource(m), m.gens,
                    None if m.refs is None else m.refs.copy())  # 4 bytes a reference
    snap.pause_s = time.perf_counter() - t0
    return snap


def _stamp() -> str:
    ns = time.time_ns()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def _write_rows(snap: Snapshot, tmp: int, buffer_bytes: int, modes: tuple[int, int]):
    """Copy the committed items' rows, oldest first, a chunk at a time: a
    gather into memory, then the stamps of that chunk (moved: a writer got
    the slot after the snapshot, the row may be torn, the item is invalid),
    then the chunk to each field's file.  An item evicted after its rows
    were gathered is kept: it was whole in the table at the snapshot.

    The disk is usually slower than the writers (here 0.27 GB/s against up
    to 1 GB/s of inserts), so gathered chunks are held in memory, up to
    ``buffer_bytes``, ahead of the disk: a table that fits is captured in
    the time of a memory copy and nothing in it churns out first.  Beyond
    that, oldest first, because a fifo remover evicts in that order."""
    slots = np.flatnonzero(snap.state == COMMITTED)
    slots = slots[np.argsort(snap.seqno[slots], kind="stable")]
    n = slots.shape[0]
    fields = slot_fields(snap.spec.fields, snap.spec.frames)
    valid = np.zeros(n, np.uint8)
    outs = {}
    ahead: collections.deque = collections.deque()
    held = 0

    def flush_one():
        nonlocal held
        rows = ahead.popleft()
        for name, r in rows.items():
            outs[name].write(r)
            held -= r.nbytes

    # a frame table's frames first: the stamps checked below then vouch for them too
    frame_files = (ckframes.write_frames(snap, slots, tmp, modes, CHUNK_BYTES)
                   if snap.refs is not None else {})
    try:
        for f in fields:  # inside the try: a name taken fails the write, and closes what is open
            outs[f.name] = SealedFile(tmp, f"f.{f.name}.bin")
        step = max(1, CHUNK_BYTES // max(1, sum(f.item_bytes for f in fields)))
        for lo in range(0, n, step):
            part = slots[lo:lo + step]
            rows = {f.name: snap.rows.take(f, part) for f in fields}
            valid[lo:lo + step] = snap.live_gens[part] == snap.gens[part]
            ahead.append(rows)
            held += sum(r.nbytes for r in rows.values())
            while held > buffer_bytes and ahead:
                flush_one()
        while ahead:
            flush_one()
        sealed = {name: out.seal(modes) for name, out in outs.items()}
    finally:
        snap.rows.close()
        for out in outs.values():
            out.f.close()  # after seal: a no-op
    files = {f"f.{f.name}": (f.dtype, (n, *f.shape), *sealed[f.name]) for f in fields}
    return slots, valid, {**files, **frame_files}


def write(snap: Snapshot, directory: str, keep: int = 0, buffer_bytes: int = 1 << 30,
          segment_mode: int = 0o660, gid: int = -1) -> dict:
    """Write a checkpoint of ``snap`` (rows read from the live table) into
    ``directory``; returns a report.  Any thread; one call per table at a
    time.  ``keep > 0`` then removes all but the newest ``keep``;
    ``buffer_bytes``: rows gathered ahead of the disk (``_write_rows``).

    ``directory`` must pass ``safedir``'s checks (ForeignObject otherwise,
    before anything is written or removed) and is made if missing; all the
    rest happens relative to its descriptor.  Files get the table's meta
    segment's mode (``segment_mode`` without group or other write: 0640)
    and group ``gid``, directories the same plus search (0750), whatever
    the umask: a checkpoint holds every row, and is never wider open than
    its table."""
    t0 = time.perf_counter()
    spec = snap.spec
    fmode = meta_mode(segment_mode) & 0o777
    modes, dmodes = (fmode, gid), (safedir.dir_mode(fmode), gid)
    final = f"{spec.name}@{_stamp()}"
    tmp = f".{final}.tmp{os.getpid()}"
    dfd = safedir.open_dir(directory, safedir.CHECKPOINTS, make=dmodes)
    try:
        tfd = safedir.make_subdir(dfd, tmp)  # outside the try below: a name taken is not ours to remove
        try:
            files = _write_all(snap, tfd, buffer_bytes, modes)
            safedir.set_mode(tfd, *dmodes)
            os.fsync(tfd)
            os.rename(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        except BaseException:
            safedir.remove(dfd, tmp, directory)
            raise
        finally:
            os.close(tfd)
        pruned = prune(dfd, directory, spec.name, keep) if keep > 0 else []
    finally:
        os.close(dfd)
    items, n = files.pop("items")
    return {"table": spec.name, "path": os.path.join(directory, final), "items": items,
            "dropped": n - items, "bytes": sum(v[2] for v in files.values()),
            "pause_s": snap.pause_s, "write_s": time.perf_counter() - t0, "pruned": pruned}


def _write_all(snap: Snapshot, tfd: int, buffer_bytes: int, modes: tuple[int, int]) -> dict:
    """Every file of the checkpoint into the directory ``tfd``, DONE last;
    the files' descriptions, and ``items``: (valid items, items)."""
    spec = snap.spec
    slots, valid, files = _write_rows(snap, tfd, buffer_bytes, modes)
    arrays = {"slots": slots, "gens": snap.gens, "prios": snap.prios[slots],
              "times": snap.times[slots], "seqno": snap.seqno[slots], "valid": valid}
    for name, a in arrays.items():
        files[name] = (a.dtype.str, a.shape, *write_file(tfd, f"{name}.bin", [a], modes))
    meta = msgpack.packb({
        "format": FORMAT, "format_version": FORMAT_VERSION, "layout_version": layout_version(spec),
        "spec": spec.to_wire(), "counters": snap.counters, "items": int(valid.sum()),
        "created_ns": time.time_ns(),
        "files": {k: {"dtype": np.dtype(d).str, "shape": list(s), "bytes": b, "crc32": c}
                  for k, (d, s, b, c) in files.items()},
    }, use_bin_type=True)
    write_file(tfd, "meta.msgpack", [np.frombuffer(meta, np.uint8)], modes)
    write_file(tfd, "DONE", [np.frombuffer(f"{zlib.crc32(meta)}\n".encode(), np.uint8)], modes)
    return {**files, "items": (int(valid.sum()), int(slots.shape[0]))}


def prune(dfd: int, directory: str, table: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` complete checkpoints of ``table``
    from the checked directory ``dfd`` (``directory``: its path), and
    temporary directories that no live process is writing.  Only
    directories of the daemon's user go, and only what they hold that is
    a file or directory of its user, never through a link
    (``safedir.remove``): anything else is logged and left."""
    gone = []
    for path in complete_in(dfd, directory, table).get(table, [])[:-keep]:
        if safedir.remove(dfd, os.path.basename(path), directory):
            gone.append(path)
    for name in os.listdir(dfd):
        if name.startswith(f".{table}@") and ".tmp" in name:
            pid = name.rsplit(".tmp", 1)[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                if safedir.remove(dfd, name, directory):
                    gone.append(name)
    return gone
