"""Reading checkpoints back: which are complete, loading and verifying one,
restoring it into a table.  The format and the write protocol are
checkpoint.py's.

A checkpoint directory is read only if it passes ``safedir``'s checks
(every component a real directory of root or the daemon's user, writable
by no one else): a directory that fails them is a ``ForeignObject``, and
nothing in it is listed or read.  Inside it, only directories of the
daemon's user are checkpoints, and only regular files of the daemon's
user, opened without following a link, are read; a link or another
user's entry is logged (listing) or a ``LayoutError`` (loading) and left
alone.

Who calls: startup (control/recovery.py: ``complete``, ``load``,
``restore``, on executor threads) and checkpoint.py's prune
(``complete_in``).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import stat
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from ...errors import ForeignObject, LayoutError, ReplayError
from ...schema import TableSpec, spec_from_wire
from ...framespec import slot_fields
from ...wire.headers import layout_version
from ...wire.layout import COMMITTED, TableMap
from . import ckframes, safedir

FORMAT = "shmreplay-checkpoint"
FORMAT_VERSION = 1
CHUNK_BYTES = 32 << 20  # bytes CRC-checked or restored at a time: bounded extra memory

log = logging.getLogger("shmreplayd.checkpoint")


def complete(directory: str, table: str | None = None) -> dict[str, list[str]]:
    """Complete checkpoints in ``directory`` by table, oldest first; none if
    it does not exist.  A directory that is not safe (``safedir``) raises
    ``ForeignObject`` naming the component and what is wrong."""
    with safedir.opened(directory, safedir.CHECKPOINTS, missing_ok=True) as dfd:
        return {} if dfd is None else complete_in(dfd, directory, table)


def complete_in(dfd: int, directory: str, table: str | None = None) -> dict[str, list[str]]:
    """``complete`` in the checked directory ``dfd`` (``directory`` is its
    path, for the names returned)."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(dfd)):
        if name.startswith(".") or "@" not in name:
            continue
        tname = name.rsplit("@", 1)[0]
        if table is not None and tname != table:
            continue
        st = safedir.entry(dfd, name)
        if not safedir.is_ours(st):
            if st is not None:
                log.warning("%s/%s is not a checkpoint the daemon wrote (%s); left alone",
                            directory, name, "a symlink" if stat.S_ISLNK(st.st_mode)
                            else f"mode {st.st_mode:o}, uid {st.st_uid}")
            continue
        try:
            cfd = safedir.open_subdir(dfd, name, directory)
        except (OSError, ForeignObject):
            continue  # changed since the look above: only the daemon's user can do that
        try:
            done = safedir.is_ours(safedir.entry(cfd, "DONE"), stat.S_ISREG)
        finally:
            os.close(cfd)
        if done:
            out.setdefault(tname, []).append(os.path.join(directory, name))
    return out


@dataclass
class Checkpoint:
    path: str
    spec: TableSpec
    counters: dict
    arrays: dict  # name -> np.ndarray (memory-mapped from the files)


def load(path: str) -> Checkpoint:
    """Read and verify a checkpoint, through descriptors of safe
    directories (module docstring).  Whatever is wrong with it (a file
    missing, short, unreadable or failing its CRC, bytes that do not
    decode, another format or layout version, a meta that does not describe
    the arrays of its own table) is a LayoutError naming the directory and
    the fault: the caller then tries the checkpoint before it, so no damage
    may escape as another exception."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        with safedir.opened(parent, safedir.CHECKPOINTS) as dfd:
            cfd = safedir.open_subdir(dfd, name, parent)
            try:
                return _load(cfd, path)
            finally:
                os.close(cfd)
    except LayoutError:
        raise
    except (ReplayError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LayoutError(f"checkpoint {path} is damaged: {type(exc).__name__}: {exc}") from exc


def _open(cfd: int, path: str, name: str) -> int:
    """A file of the checkpoint: a regular file of the daemon's user, or a
    LayoutError (ForeignObject, if it is something else)."""
    try:
        return safedir.open_file(cfd, name, path)
    except FileNotFoundError:
        raise LayoutError(f"checkpoint {path}: {name} is missing") from None


def _read(cfd: int, path: str, name: str) -> bytes:
    with os.fdopen(_open(cfd, path, name), "rb") as f:
        return f.read()


def _load(cfd: int, path: str) -> Checkpoint:
    done = _read(cfd, path, "DONE")  # bytes: a damaged marker must not fail to decode
    raw = _read(cfd, path, "meta.msgpack")
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
    for key, want in (("format_version", FORMAT_VERSION), ("layout_version", layout_version(spec))):
        if meta.get(key) != want:  # the arrays mean what this version's segment means
            raise LayoutError(f"checkpoint {path} has {key.replace('_', ' ')} {meta.get(key)}, "
                              f"this build reads version {want}")
    files, counters = meta["files"], meta["counters"]
    n = int(files["slots"]["shape"][0])
    want = {"slots": (np.int64, (n,)), "gens": (np.uint32, (spec.capacity,)),
            "prios": (np.float64, (n,)), "times": (np.uint32, (n,)), "seqno": (np.uint64, (n,)),
            "valid": (np.uint8, (n,))}
    want.update({f"f.{f.name}": (f.dtype, (n, *f.shape)) for f in slot_fields(spec.fields, spec.frames)})
    want.update(ckframes.wanted(spec, files, n))
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
        arrays[name] = _array(cfd, path, name, np.dtype(dtype), shape, d)
    return Checkpoint(path, spec, counters, arrays)


def _array(cfd: int, path: str, name: str, dtype: np.dtype, shape: tuple, d: dict) -> np.ndarray:
    """One array file, mapped once its size and CRC-32 are checked."""
    fd = _open(cfd, path, f"{name}.bin")
    try:
        size, nbytes = os.fstat(fd).st_size, dtype.itemsize * math.prod(shape)
        if size != nbytes or d["bytes"] != nbytes:
            raise LayoutError(f"checkpoint {path}: {name}.bin is {size} bytes, expected {nbytes}")
        # the array keeps the mapping; the descriptor is not needed past this
        a = (np.frombuffer(mmap.mmap(fd, nbytes, prot=mmap.PROT_READ), dtype).reshape(shape)
             if nbytes else np.empty(shape, dtype))
    finally:
        os.close(fd)
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
    if ck.spec.frames:
        ckframes.restore_frames(ck, tmap, ok, slots, CHUNK_BYTES)
    for f in slot_fields(ck.spec.fields, ck.spec.frames):
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
