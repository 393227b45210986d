"""A frame table's part of a checkpoint (checkpoint.py has the format and
the write protocol; docs/frames.md the frame table):

    refs.bin              uint32[n, refs an item]  each item's frame references,
                          as the snapshot saw them
    frameidx.<base>.bin   uint32[k]  the frames of ``base``'s ring the items
                          reference, sorted
    frames.<base>.bin     uint8[k, frame bytes]  those frames

Writing copies the frames before the items' rows and their stamps'
re-check (``checkpoint._write_rows``): an item whose stamp still holds at
the re-check held its references since the snapshot, so none of its
frames was handed to a writer before they were copied, and its stack is
whole.  An item whose stamp moved is marked invalid with its rows.

Restoring writes the frames back at the same indices of a fresh table's
rings and the valid items' references into its meta segment; the
table's recovery counts them (``TableFrames.adopt``).  A checkpoint is
verified first (checkpoint.py: CRCs), and every index is bounded here:
a frame outside its ring, or an item referencing a frame the checkpoint
does not hold, is a ``LayoutError`` (the caller tries an older one).

Who calls: checkpoint.py (``write_frames``, executor thread, after the
engine's ``snapshot`` copied the references) and ckread.py (``wanted``,
``restore_frames``, executor threads at startup).  Pure over their
arguments.
"""

from __future__ import annotations

import numpy as np

from ...errors import LayoutError
from ...framespec import frame_bytes
from .sealed import SealedFile, write_file


def ring_columns(spec) -> dict[str, np.ndarray]:
    """Each base's columns in an item's references."""
    cols: dict[str, list[int]] = {b: [] for b in spec.frames.bases}
    for _, base, col0, depth in spec.frames.columns:
        cols[base] += range(col0, col0 + depth)
    return {b: np.asarray(c, dtype=np.int64) for b, c in cols.items()}


def write_frames(snap, slots: np.ndarray, tmp: int, modes: tuple[int, int], chunk_bytes: int) -> dict:
    """The frame files of the items in ``slots`` (their references: the
    snapshot's copy) into the checkpoint's directory ``tmp``; returns their
    descriptions, as ``checkpoint._write_rows``' ``files``."""
    spec = snap.spec
    refs = np.ascontiguousarray(snap.refs[slots])
    files = {"refs": (refs.dtype.str, refs.shape, *write_file(tmp, "refs.bin", [refs], modes))}
    by_name = {f.name: f for f in spec.fields}
    for base, cols in ring_columns(spec).items():
        idx = np.unique(refs[:, cols]).astype(np.uint32)
        fb = frame_bytes(by_name[base])
        out = SealedFile(tmp, f"frames.{base}.bin")
        try:
            step = max(1, chunk_bytes // fb)
            for lo in range(0, idx.shape[0], step):
                out.write(snap.rows.take_frames(base, idx[lo:lo + step].astype(np.int64)))
        except BaseException:
            out.f.close()
            raise
        files[f"frames.{base}"] = ("|u1", (idx.shape[0], fb), *out.seal(modes))
        files[f"frameidx.{base}"] = (idx.dtype.str, idx.shape,
                                     *write_file(tmp, f"frameidx.{base}.bin", [idx], modes))
    return files


def wanted(spec, files: dict, n: int) -> dict:
    """The frame files a checkpoint of ``spec`` with ``n`` items lists:
    name -> (dtype, shape), their frame counts read from its meta."""
    if not spec.frames:
        return {}
    by_name = {f.name: f for f in spec.fields}
    want = {"refs": (np.uint32, (n, spec.frames.refs_per_item))}
    for base in spec.frames.bases:
        k = int(files.get(f"frameidx.{base}", {}).get("shape", [0])[0])
        want[f"frameidx.{base}"] = (np.uint32, (k,))
        want[f"frames.{base}"] = (np.uint8, (k, frame_bytes(by_name[base])))
    return want


def restore_frames(ck, tmap, ok: np.ndarray, slots: np.ndarray, chunk_bytes: int) -> None:
    """The frames and the valid items' references of checkpoint ``ck`` into
    a fresh table's rings and meta segment (``ok``: the valid items,
    ``slots``: theirs); bounded first."""
    spec = ck.spec
    a = ck.arrays
    refs = np.asarray(a["refs"])[ok]
    for base, cols in ring_columns(spec).items():
        ring = tmap.rings[base]
        idx = np.asarray(a[f"frameidx.{base}"]).astype(np.int64)
        if idx.shape[0] and (idx.max() >= ring.shape[0] or np.any(np.diff(idx) <= 0)):
            raise LayoutError(f"checkpoint {ck.path}: frames of ring {base!r} outside its "
                              f"{ring.shape[0]} frames, or not sorted and distinct")
        if refs.shape[0] and not np.isin(refs[:, cols], idx).all():
            raise LayoutError(f"checkpoint {ck.path}: items reference frames of ring {base!r} "
                              "it does not hold")
        src = a[f"frames.{base}"]
        step = max(1, chunk_bytes // max(1, ring.shape[1]))
        for lo in range(0, idx.shape[0], step):
            ring[idx[lo:lo + step]] = src[lo:lo + step]
    tmap.refs[slots] = refs
