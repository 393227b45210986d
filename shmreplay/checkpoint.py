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
   of the committed items and the counters.  That copy, O(capacity) bytes
   of metadata and no row data, is the only pause inserts and samples see.
2. ``write`` copies the rows of those items while writers go on, then
   re-reads the generation stamps: a slot whose stamp moved was reserved by
   a writer during the copy, so its row may be torn and it is marked invalid
   (the same check a learner makes after a gather).  Stamps only grow, so
   one check after all the copies covers every field.
3. Every file is written into ``DIR/.T@<time>.tmp<pid>``, fsynced, DONE
   last, the directory fsynced and renamed into place, and DIR fsynced:
   a crash at any point leaves either the old checkpoints or the new one.

The checkpoint is the table as the snapshot saw it, minus items evicted
during the copy.  Restoring (``restore``) writes the items back into the
same slots with the same stamps, so the round trip is bit-exact and keys a
learner holds stay valid; the table then starts through the same recovery
path as a table adopted after a crash (``Table._recover``).
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from .errors import LayoutError, ReplayError
from .layout import COMMITTED, LAYOUT_VERSION, LIVE_DELETES, LIVE_EPOCH, LIVE_INSERTS, \
    LIVE_SAMPLES, TableMap
from .schema import TableSpec, spec_from_wire

FORMAT = "shmreplay-checkpoint"
FORMAT_VERSION = 1
CHUNK_BYTES = 32 << 20  # rows copied per gather: bounded extra memory
ITEM_ARRAYS = {"slots": np.int64, "prios": np.float64, "times": np.uint32, "seqno": np.uint64}


@dataclass
class Snapshot:
    spec: TableSpec
    slots: np.ndarray   # committed slots, in commit order
    gens: np.ndarray    # every slot's stamp
    prios: np.ndarray
    times: np.ndarray
    seqno: np.ndarray
    counters: dict
    pause_s: float
    views: dict           # the live field arrays and stamps, kept mapped while
    live_gens: np.ndarray  # written even if the table is dropped meanwhile


def snapshot(table) -> Snapshot:
    """Engine thread only: the committed items' metadata and the counters."""
    t0 = time.perf_counter()
    m = table.map
    slots = np.flatnonzero(m.state == COMMITTED)
    slots = slots[np.argsort(m.seqno[slots], kind="stable")]
    snap = Snapshot(table.spec, slots, m.gens.copy(), m.prios[slots], m.times[slots],
                    m.seqno[slots],
                    {"inserts": table.inserts, "samples": table.samples, "deletes": table.deletes,
                     "epoch": int(m.live[LIVE_EPOCH])}, 0.0, dict(m.fields), m.gens)
    snap.pause_s = time.perf_counter() - t0
    return snap


def _stamp() -> str:
    ns = time.time_ns()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def _write_file(path: str, arrays) -> tuple[int, int]:
    """Write the arrays' bytes one after another; fsync; (bytes, crc32)."""
    crc, size = 0, 0
    with open(path, "wb") as f:
        for a in arrays:
            mv = memoryview(np.ascontiguousarray(a)).cast("B")
            f.write(mv)
            crc = zlib.crc32(mv, crc)
            size += mv.nbytes
        f.flush()
        os.fsync(f.fileno())
    return size, crc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(snap: Snapshot, directory: str, keep: int = 0) -> dict:
    """Write a checkpoint of ``snap`` (rows read from the live table) into
    ``directory``; returns a report.  Any thread; one call per table at a
    time.  ``keep > 0`` then removes all but the newest ``keep``."""
    t0 = time.perf_counter()
    spec = snap.spec
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"{spec.name}@{_stamp()}")
    tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp{os.getpid()}")
    os.mkdir(tmp)
    try:
        files = {}
        n = snap.slots.shape[0]
        for f in spec.fields:
            view = snap.views[f.name]
            step = max(1, CHUNK_BYTES // max(1, f.item_bytes))
            chunks = (np.take(view, snap.slots[lo:lo + step], axis=0) for lo in range(0, n, step))
            files[f"f.{f.name}"] = (f.dtype, (n, *f.shape), *_write_file(
                os.path.join(tmp, f"f.{f.name}.bin"), chunks))
        # after every row is copied: a moved stamp means a writer had the slot
        valid = (snap.live_gens[snap.slots] == snap.gens[snap.slots]).astype(np.uint8)
        arrays = {"slots": snap.slots, "gens": snap.gens, "prios": snap.prios,
                  "times": snap.times, "seqno": snap.seqno, "valid": valid}
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
    """Read and verify a checkpoint (format, version, sizes, CRCs)."""
    if not os.path.exists(os.path.join(path, "DONE")):
        raise LayoutError(f"checkpoint {path} is incomplete (no DONE marker)")
    with open(os.path.join(path, "meta.msgpack"), "rb") as f:
        raw = f.read()
    with open(os.path.join(path, "DONE")) as f:
        if f.read().strip() != str(zlib.crc32(raw)):
            raise LayoutError(f"checkpoint {path}: meta.msgpack does not match its DONE marker")
    try:
        meta = msgpack.unpackb(raw, raw=False)
        if meta.get("format") != FORMAT:
            raise LayoutError(f"{path} is not a shmreplay checkpoint")
        if meta.get("format_version") != FORMAT_VERSION:
            raise LayoutError(f"checkpoint {path} has format version {meta.get('format_version')}, "
                              f"this build reads version {FORMAT_VERSION}")
        spec = spec_from_wire(meta["spec"])
    except LayoutError:
        raise
    except Exception as exc:
        raise LayoutError(f"checkpoint {path} has an unreadable meta.msgpack: {exc}") from exc
    arrays = {}
    for name, d in meta["files"].items():
        fpath = os.path.join(path, f"{name}.bin")
        if os.path.getsize(fpath) != d["bytes"]:
            raise LayoutError(f"checkpoint {path}: {name}.bin is {os.path.getsize(fpath)} bytes, "
                              f"expected {d['bytes']}")
        a = (np.memmap(fpath, dtype=np.dtype(d["dtype"]), mode="r", shape=tuple(d["shape"]))
             if d["bytes"] else np.empty(tuple(d["shape"]), np.dtype(d["dtype"])))
        flat = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        crc = 0
        for lo in range(0, flat.shape[0], CHUNK_BYTES):
            crc = zlib.crc32(flat[lo:lo + CHUNK_BYTES], crc)
        if crc != d["crc32"]:
            raise LayoutError(f"checkpoint {path}: {name}.bin fails its CRC-32 check")
        arrays[name] = a
    return Checkpoint(path, spec, meta["counters"], arrays)


def restore(ck: Checkpoint, tmap: TableMap) -> int:
    """Write a loaded checkpoint into a freshly created, empty table segment
    of the same spec; returns how many items.  The caller then builds the
    ``Table`` with ``recover=True``."""
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
    tmap.live[LIVE_INSERTS] = c["inserts"]
    tmap.live[LIVE_SAMPLES] = c["samples"]
    tmap.live[LIVE_DELETES] = c["deletes"]
    tmap.live[LIVE_EPOCH] = c["epoch"]
    return int(slots.shape[0])
