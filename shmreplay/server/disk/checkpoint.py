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
    f.<field>.bin   dtype[n, *shape]  each field's rows
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

The checkpoint is the table as the snapshot saw it, minus items evicted
before their rows were copied.  Restoring (``restore``) writes the items back into the
same slots with the same stamps, so the round trip is bit-exact and keys a
learner holds stay valid; the table then starts through the same recovery
path as a table adopted after a crash (``recovery.rebuild``).
"""

from __future__ import annotations

import collections
import math
import os
import time
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from ...errors import LayoutError, ReplayError
from ...schema import TableSpec, spec_from_wire
from ...wire.layout import COMMITTED, LAYOUT_VERSION, TableMap
from .rowread import RowSource

FORMAT = "shmreplay-checkpoint"
FORMAT_VERSION = 1
CHUNK_BYTES = 32 << 20  # rows copied per gather: bounded extra memory


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
                     "epoch": m.words.epoch}, 0.0, RowSource(m), m.gens)
    snap.pause_s = time.perf_counter() - t0
    return snap


def _stamp() -> str:
    ns = time.time_ns()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


class _SealedFile:
    """A file written in parts, its CRC-32 kept as it goes, fsynced when sealed."""

    def __init__(self, path: str):
        self.f = open(path, "wb")
        self.crc = self.size = 0

    def write(self, a: np.ndarray) -> None:
        mv = memoryview(np.ascontiguousarray(a)).cast("B")
        self.f.write(mv)
        self.crc = zlib.crc32(mv, self.crc)
        self.size += mv.nbytes

    def seal(self) -> tuple[int, int]:
        """fsync and close; (bytes, crc32)."""
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.size, self.crc


def _write_file(path: str, arrays) -> tuple[int, int]:
    """Write the arrays' bytes one after another; fsync; (bytes, crc32)."""
    out = _SealedFile(path)
    try:
        for a in arrays:
            out.write(a)
    except BaseException:
        out.f.close()
        raise
    return out.seal()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_rows(snap: Snapshot, tmp: str, buffer_bytes: int):
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
    fields = snap.spec.fields
    valid = np.zeros(n, np.uint8)
    outs = {f.name: _SealedFile(os.path.join(tmp, f"f.{f.name}.bin")) for f in fields}
    ahead: collections.deque = collections.deque()
    held = 0

    def flush_one():
        nonlocal held
        rows = ahead.popleft()
        for name, r in rows.items():
            outs[name].write(r)
            held -= r.nbytes

    try:
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
        sealed = {name: out.seal() for name, out in outs.items()}
    finally:
        snap.rows.close()
        for out in outs.values():
            out.f.close()  # after seal: a no-op
    files = {f"f.{f.name}": (f.dtype, (n, *f.shape), *sealed[f.name]) for f in fields}
    return slots, valid, files


def write(snap: Snapshot, directory: str, keep: int = 0, buffer_bytes: int = 1 << 30) -> dict:
    """Write a checkpoint of ``snap`` (rows read from the live table) into
    ``directory``; returns a report.  Any thread; one call per table at a
    time.  ``keep > 0`` then removes all but the newest ``keep``;
    ``buffer_bytes``: rows gathered ahead of the disk (``_write_rows``)."""
    t0 = time.perf_counter()
    spec = snap.spec
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"{spec.name}@{_stamp()}")
    tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp{os.getpid()}")
    os.mkdir(tmp)
    try:
        slots, valid, files = _write_rows(snap, tmp, buffer_bytes)
        n = slots.shape[0]
        arrays = {"slots": slots, "gens": snap.gens, "prios": snap.prios[slots],
                  "times": snap.times[slots], "seqno": snap.seqno[slots], "valid": valid}
        for name, a in arrays.items():
            files[name] = (a.dtype.str, a.shape, *_write_file(os.path.join(tmp, f"{name}.bin"), [a]))
        meta = msgpack.packb({
            "format": FORMAT, "format_version": FORMAT_VERSION, "layout_version": LAYOUT_VERSION,
            "spec": spec.to_wire(), "counters": snap.counters, "items": int(valid.sum()),
            "created_ns": time.time_ns(),
            "files": {k: {"dtype": np.dtype(d).str, "shape": list(s), "bytes": b, "crc32": c}
                      for k, (d, s, b, c) in files.items()},
        }, use_bin_type=True)
        _write_file(os.path.join(tmp, "meta.msgpack"), [np.frombuffer(meta, np.uint8)])
        _write_file(os.path.join(tmp, "DONE"), [np.frombuffer(
            f"{zlib.crc32(meta)}\n".encode(), np.uint8)])
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        _rmtree(tmp)
        raise
    pruned = prune(directory, spec.name, keep) if keep > 0 else []
    total = sum(v[2] for v in files.values())
    return {"table": spec.name, "path": final, "items": int(valid.sum()),
            "dropped": int(n - valid.sum()), "bytes": total, "pause_s": snap.pause_s,
            "write_s": time.perf_counter() - t0, "pruned": pruned}


def _rmtree(path: str) -> None:
    if not os.path.isdir(path):
        return
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def complete(directory: str, table: str | None = None) -> dict[str, list[str]]:
    """Complete checkpoints in ``directory`` by table, oldest first."""
    out: dict[str, list[str]] = {}
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        if name.startswith(".") or "@" not in name:
            continue
        tname = name.rsplit("@", 1)[0]
        if table is not None and tname != table:
            continue
        path = os.path.join(directory, name)
        if os.path.exists(os.path.join(path, "DONE")):
            out.setdefault(tname, []).append(path)
    return out


def prune(directory: str, table: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` complete checkpoints of ``table``,
    and temporary directories that no live process is writing."""
    gone = []
    for path in complete(directory, table).get(table, [])[:-keep]:
        _rmtree(path)
        gone.append(path)
    for name in os.listdir(directory):
        if name.startswith(f".{table}@") and ".tmp" in name:
            pid = name.rsplit(".tmp", 1)[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _rmtree(os.path.join(directory, name))
                gone.append(name)
    return gone


@dataclass
class Checkpoint:
    path: str
    spec: TableSpec
    counters: dict
    arrays: dict  # name -> np.ndarray (memory-mapped from the files)


def load(path: str) -> Checkpoint:
    """Read and verify a checkpoint.  Whatever is wrong with it (a file
    missing, short, unreadable or failing its CRC, bytes that do not
    decode, another format or layout version, a meta that does not describe
    the arrays of its own table) is a LayoutError naming the directory and
    the fault: the caller then tries the checkpoint before it, so no damage
    may escape as another exception."""
    try:
        return _load(path)
    except LayoutError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LayoutError(f"checkpoint {path} is damaged: {type(exc).__name__}: {exc}") from exc


def _read(path: str, name: str) -> bytes:
    try:
        with open(os.path.join(path, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise LayoutError(f"checkpoint {path}: {name} is missing") from None


def _load(path: str) -> Checkpoint:
    done = _read(path, "DONE")  # bytes: a damaged marker must not fail to decode
    raw = _read(path, "meta.msgpack")
    if done.strip() != str(zlib.crc32(raw)).encode():
        raise LayoutError(f"checkpoint {path}: meta.msgpack does not match its DONE marker "
                          f"(DONE holds {done[:24]!r})")
    try:
        meta = msgpack.unpackb(raw, raw=False)
        spec = spec_from_wire(meta["spec"])
    except Exception as exc:
        raise LayoutError(f"checkpoint {path} has an unreadable meta.msgpack: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise LayoutError(f"{path} is not a shmreplay checkpoint")
    for key, want in (("format_version", FORMAT_VERSION), ("layout_version", LAYOUT_VERSION)):
        if meta.get(key) != want:  # the arrays mean what this version's segment means
            raise LayoutError(f"checkpoint {path} has {key.replace('_', ' ')} {meta.get(key)}, "
                              f"this build reads version {want}")
    files, counters = meta["files"], meta["counters"]
    n = int(files["slots"]["shape"][0])
    want = {"slots": (np.int64, (n,)), "gens": (np.uint32, (spec.capacity,)),
            "prios": (np.float64, (n,)), "times": (np.uint32, (n,)), "seqno": (np.uint64, (n,)),
            "valid": (np.uint8, (n,))}
    want.update({f"f.{f.name}": (f.dtype, (n, *f.shape)) for f in spec.fields})
    if set(files) != set(want) or not all(isinstance(counters[k], int) for k in
                                          ("inserts", "samples", "deletes", "epoch")):
        raise LayoutError(f"checkpoint {path}: meta.msgpack lists files {sorted(files)} and "
                          f"counters {counters}, not those of table {spec.name!r}")
    arrays = {}
    for name, (dtype, shape) in want.items():
        d = files[name]
        if np.dtype(d["dtype"]) != np.dtype(dtype) or tuple(d["shape"]) != shape:
            raise LayoutError(f"checkpoint {path}: {name}.bin is described as {d['dtype']} "
                              f"{d['shape']}, table {spec.name!r} needs {np.dtype(dtype).str} {shape}")
        arrays[name] = _array(path, name, np.dtype(dtype), shape, d)
    return Checkpoint(path, spec, counters, arrays)


def _array(path: str, name: str, dtype: np.dtype, shape: tuple, d: dict) -> np.ndarray:
    """One array file, memory-mapped once its size and CRC-32 are checked."""
    fpath = os.path.join(path, f"{name}.bin")
    if not os.path.exists(fpath):
        raise LayoutError(f"checkpoint {path}: {name}.bin is missing")
    size, nbytes = os.path.getsize(fpath), dtype.itemsize * math.prod(shape)
    if size != nbytes or d["bytes"] != nbytes:
        raise LayoutError(f"checkpoint {path}: {name}.bin is {size} bytes, expected {nbytes}")
    a = np.memmap(fpath, dtype=dtype, mode="r", shape=shape) if nbytes else np.empty(shape, dtype)
    flat = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    crc = 0
    for lo in range(0, flat.shape[0], CHUNK_BYTES):
        crc = zlib.crc32(flat[lo:lo + CHUNK_BYTES], crc)
    if crc != d["crc32"]:
        raise LayoutError(f"checkpoint {path}: {name}.bin fails its CRC-32 check")
    return a


def restore(ck: Checkpoint, tmap: TableMap) -> int:
    """Write a loaded checkpoint into a freshly created, empty table segment
    of the same spec; returns how many items.  The caller then builds the
    table with ``recovery.rebuild``."""
    if tmap.spec != ck.spec:
        raise ReplayError(f"checkpoint {ck.path} holds table {ck.spec}, not {tmap.spec}")
    a = ck.arrays
    ok = np.asarray(a["valid"]).astype(bool)
    slots = np.asarray(a["slots"])[ok]
    if slots.shape[0] and (slots.min() < 0 or slots.max() >= ck.spec.capacity):
        raise LayoutError(f"checkpoint {ck.path}: slot index outside capacity {ck.spec.capacity}")
    tmap.gens[:] = a["gens"]
    tmap.prios[slots] = np.asarray(a["prios"])[ok]
    tmap.times[slots] = np.asarray(a["times"])[ok]
    tmap.seqno[slots] = np.asarray(a["seqno"])[ok]
    for f in ck.spec.fields:
        src = a[f"f.{f.name}"]
        view = tmap.fields[f.name]
        rows = np.flatnonzero(ok)
        step = max(1, CHUNK_BYTES // max(1, f.item_bytes))
        for lo in range(0, rows.shape[0], step):
            view[slots[lo:lo + step]] = src[rows[lo:lo + step]]
    tmap.state[slots] = COMMITTED
    c = ck.counters
    tmap.words.set_counters(c["inserts"], c["samples"], c["deletes"])
    tmap.words.epoch = c["epoch"]
    return int(slots.shape[0])
