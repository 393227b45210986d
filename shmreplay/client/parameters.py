"""``ParameterBoard``: a learner publishes model parameters, many actors
read the newest, none of them ever sees a torn copy.

    # learner
    board = shmreplay.ParameterBoard.create(client, "policy", like=params)
    board.publish(params)                       # -> version 1, 2, ...
    # actor (any process of the daemon's users)
    board = shmreplay.ParameterBoard.attach(client, "policy", like=params)
    got = board.latest(newer_than=seen)         # None, or (version, {name: array})

``params`` is a mapping of names to numpy arrays (a torch ``state_dict``
goes through ``shmreplay.torch.numpy_state``).  A board is an ordinary
table of a few slots (``slots``, default 3) with a ``lifo`` sampler and a
``fifo`` remover, and one item per published version: its fields are
``version`` (int64), ``layout`` (a hash of the names, dtypes and shapes)
and ``blob`` (every array's bytes, 64-byte aligned).  So it needs nothing
new from the daemon, and a read is a one-item sample, with the sample
path's guarantees: the row is copied, then its slot's generation stamp is
checked, and a slot overwritten during the copy is read again (each
publish overwrites the oldest of ``slots`` versions, so a reader is torn
only if ``slots - 1`` publishes land during one copy, and then it reads
again; the board's ``rereads`` counts those).  A reader with another
model (other names, dtypes or shapes) is told so instead of reading garbage.

Reads are cheap when nothing changed: ``latest(newer_than=v)`` looks at the
table's insert counter in shared memory first (no round trip) and returns
None if no version was published since the reader's last read.

Who calls it: one publisher per board (versions count up from the newest
on the table when it attaches), any number of readers; each board object
uses its client's thread rule (one thread at a time).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..errors import EmptyTable, FieldError, RateLimited, ReplayError

ALIGN = 64


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: np.dtype
    shape: tuple
    offset: int
    nbytes: int


def _layout(like) -> tuple[list[_Entry], int, int]:
    """Entries in the mapping's order, the blob's size, and the layout hash."""
    if not hasattr(like, "items"):
        raise ReplayError("like= must be a mapping of names to arrays (a state_dict: see "
                          "shmreplay.torch.numpy_state)")
    entries, off, h = [], 0, hashlib.blake2b(digest_size=8)
    for name, value in like.items():
        a = np.asarray(value)
        if a.dtype.hasobject or a.dtype.kind not in "biuf":
            raise FieldError(f"parameter {name!r}: dtype {a.dtype} is not a plain number; "
                             "give numeric arrays")
        entries.append(_Entry(str(name), a.dtype.newbyteorder("="), a.shape, off, a.nbytes))
        h.update(f"{name}|{a.dtype.str}|{a.shape};".encode())
        off += -(-a.nbytes // ALIGN) * ALIGN
    if not entries:
        raise ReplayError("like= has no parameters")
    return entries, max(off, 1), int.from_bytes(h.digest(), "little", signed=True)


class ParameterBoard:
    """Newest-version parameters in a small table (see the module docstring)."""

    def __init__(self, table, like):
        self.table = table
        self.entries, self.nbytes, self.layout = _layout(like)
        got = {f.name: f for f in table.spec.fields}
        blob = got.get("blob")
        if set(got) != {"version", "layout", "blob"} or blob.shape != (self.nbytes,):
            raise FieldError(f"table {table.name!r} is not a parameter board for these parameters "
                             f"(a board's blob holds {self.nbytes} bytes; this table has fields "
                             f"{sorted(got)}{'' if blob is None else f', blob of {blob.shape[0]}'}): "
                             "attach with the model the publisher uses")
        self._out = None
        self._seen_inserts = -1
        self.version = 0  # the newest version this object published or read
        # reads this board's ``latest`` made again because a publish
        # overwrote the slot during the copy (its stamp moved): each one a
        # torn copy the stamp check caught and replaced
        self.rereads = 0

    # ---- making ----
    @classmethod
    def create(cls, client, name: str, like, slots: int = 3, exist_ok: bool = True) -> "ParameterBoard":
        """The publisher's side: make (or, with ``exist_ok``, reuse) the
        board's table; publishing continues from its newest version."""
        if not isinstance(slots, int) or slots < 2:
            raise ReplayError(f"slots must be an int >= 2 (a reader copies one while the next is "
                              f"written), got {slots!r}")
        _, nbytes, _ = _layout(like)
        fields = {"version": ("int64", ()), "layout": ("int64", ()), "blob": ("uint8", (nbytes,))}
        table = client.create_table(name, slots, fields, sampler="lifo", remover="fifo",
                                    exist_ok=exist_ok)
        board = cls(table, like)
        newest = board.latest()
        board.version = 0 if newest is None else newest[0]
        return board

    @classmethod
    def attach(cls, client, name: str, like) -> "ParameterBoard":
        """A reader's side: the board's table must exist (UnknownTable if not)."""
        return cls(client.table(name), like)

    # ---- publishing ----
    def publish(self, params, flush: bool = False) -> int:
        """Publish ``params`` (same names, dtypes and shapes as ``like``) as
        the next version; returns it.  Readers see it once the daemon has
        applied the insert (microseconds), at once after ``flush=True``."""
        blob = np.zeros(self.nbytes, np.uint8)
        for e in self.entries:
            try:
                a = np.asarray(params[e.name])
            except KeyError:
                raise FieldError(f"publish: parameter {e.name!r} is missing") from None
            if a.shape != e.shape or a.dtype != e.dtype:
                raise FieldError(f"publish: parameter {e.name!r} is {a.dtype}{list(a.shape)}, the "
                                 f"board holds {e.dtype}{list(e.shape)}")
            blob[e.offset:e.offset + e.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if len(params) != len(self.entries):
            extra = sorted(set(params) - {e.name for e in self.entries})
            raise FieldError(f"publish: parameters {extra} are not on the board")
        self.version += 1
        self.table.insert(version=self.version, layout=self.layout, blob=blob)
        if flush:
            self.table.flush()
        return self.version

    # ---- reading ----
    def latest(self, newer_than: int | None = None, timeout: float = 0.0):
        """The newest published version as ``(version, {name: array})``, or
        None if there is none yet, or none newer than ``newer_than``.  The
        arrays are views of one buffer this board reuses on its next read
        (copy what must outlive it, e.g. into the model's own tensors).
        ``timeout``: how long to wait for a first version (0: not at all)."""
        t = self.table
        if newer_than is not None and t.inserts == self._seen_inserts:
            return None  # nothing published since the last read: no round trip
        if len(t) == 0 and timeout == 0.0:
            return None
        seen = t.inserts
        try:
            b = t.sample(1, out=self._out, timeout=timeout)
        except (EmptyTable, RateLimited):
            if len(t) == 0:
                return None
            raise
        self._out = b
        self._seen_inserts = seen
        self.rereads += b.redraws
        version, layout = int(b.data["version"][0]), int(b.data["layout"][0])
        if layout != self.layout:
            raise FieldError(f"board {t.name!r}: version {version} was published with another "
                             "model (names, dtypes or shapes differ from like=)")
        if newer_than is not None and version <= newer_than:
            return None
        self.version = max(self.version, version)
        blob = b.data["blob"][0]
        return version, {e.name: blob[e.offset:e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
                         for e in self.entries}
