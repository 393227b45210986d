"""``ParameterBoard``: a learner publishes model parameters, many actors
read the newest, none of them ever sees a torn copy or another user's values.

    # learner
    board = shmreplay.ParameterBoard.create(client, "policy", like=params)
    board.publish(params)                       # -> version 1, 2, ... (the daemon's)
    # actor (any process of the daemon's users)
    board = shmreplay.ParameterBoard.attach(client, "policy", like=params)
    got = board.latest(newer_than=seen)         # None, or (version, {name: array})

``params`` is a mapping of names to numpy arrays (a torch ``state_dict``
goes through ``shmreplay.torch.numpy_state``).  A board is a table of a few
slots (``slots``, default 3; a ``lifo`` sampler, a ``fifo`` remover) made
with ``writers="creator"``: the daemon takes its inserts only from the
user who created it (and the daemon's admins), and its rows are group
read-only, so no other user can publish into it or write its rows
(docs/reliability.md, section 10).  One item per published version: its
fields are ``layout`` (a hash of the names, dtypes and shapes) and
``blob`` (every array's bytes, 64-byte aligned).  The version is the
item's commit number, which the daemon writes into the meta segment
(``seqno``; clients map it read-only): no publisher chooses it, so no
one can freeze readers with a version from the future.

A read copies the newest committed item straight from shared memory, no
round trip: the slot with the highest commit number, its stamp read
before and after the copy (a publish reserves a slot, bumping its stamp,
before it writes).  A copy a publish overwrote is made again (``rereads``
counts them), at most ``READ_TRIES`` times; then the read becomes a
protected sample (``client/draws.py``: the daemon pins the slot for the
second copy), so a reader gets a whole version however fast the learner
publishes.  A reader with another model (other names, dtypes or shapes)
is told so instead of reading garbage.  ``latest(newer_than=v)`` first
looks at the table's insert counter (no round trip) and returns None if
nothing was published since the reader's last read.

A reader trusts a board published by its own user, root or the daemon's
user; another publisher (a member's board) only if named with
``attach(..., publisher=uid)``: so a board another user made first under
the expected name is refused, not read.

Who calls it: the publisher (the board's creator, or an admin) and any
number of readers; each board object uses its client's thread rule (one
thread at a time).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import time
from dataclasses import dataclass

import numpy as np

from ..errors import EmptyTable, FieldError, PermissionDenied, RateLimited, ReplayError, ReplayTimeout
from ..wire.layout import COMMITTED
from ..wire.names import SHM_DIR

ALIGN = 64
# direct copies a publish may tear before a read becomes a protected
# sample, and the pauses between them (doubling): a learner that publishes
# faster than a reader copies gets the reader a pinned copy instead
READ_TRIES = 8
PAUSE_S = (20e-6, 5e-3)
_TORN = object()


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

    def __init__(self, table, like, publisher=None):
        self.table = table
        self.entries, self.nbytes, self.layout = _layout(like)
        spec = table.spec
        got = {f.name: f for f in spec.fields}
        blob = got.get("blob")
        if set(got) != {"layout", "blob"} or blob.shape != (self.nbytes,):
            raise FieldError(f"table {table.name!r} is not a parameter board for these parameters "
                             f"(a board's blob holds {self.nbytes} bytes; this table has fields "
                             f"{sorted(got)}{'' if blob is None else f', blob of {blob.shape[0]}'}): "
                             "attach with the model the publisher uses")
        if not spec.writer_only:
            raise PermissionDenied(f"table {table.name!r} is not a parameter board: any client may write "
                                   "it (made without writers=\"creator\"); make boards with "
                                   "ParameterBoard.create")
        _check_publisher(table, publisher)
        self._buf = np.empty(self.nbytes, np.uint8)  # the reader's copy (latest's arrays view it)
        self._out = None  # the protected sample's batch
        self._lease = None  # the publisher's (publish makes it)
        self._seen_inserts = -1
        self.version = 0  # the newest version this object published or read
        # copies a publish overwrote while this board's ``latest`` made
        # them (the stamp moved): each one a torn copy caught and made again
        self.rereads = 0

    # ---- making ----
    @classmethod
    def create(cls, client, name: str, like, slots: int = 3, exist_ok: bool = True) -> "ParameterBoard":
        """The publisher's side: make (or, with ``exist_ok``, reuse) the
        board's table, which only this user and the daemon's admins may
        write; versions continue from the newest on it."""
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 2:
            raise ReplayError(f"slots must be an int >= 2 (a reader copies one while the next is "
                              f"written), got {slots!r}")
        _, nbytes, _ = _layout(like)
        fields = {"layout": ("int64", ()), "blob": ("uint8", (nbytes,))}
        table = client.create_table(name, slots, fields, sampler="lifo", remover="fifo",
                                    exist_ok=exist_ok, writers="creator")
        board = cls(table, like)  # another user's board of this name (made first) is refused
        newest = board.latest()
        board.version = 0 if newest is None else newest[0]
        return board

    @classmethod
    def attach(cls, client, name: str, like, publisher=None) -> "ParameterBoard":
        """A reader's side: the board's table must exist (UnknownTable if
        not).  ``publisher``: a uid or user name trusted to publish it, if
        it is not this user, root or the daemon's user."""
        return cls(client.table(name), like, publisher)

    # ---- publishing ----
    def publish(self, params, flush: bool = True) -> int:
        """Publish ``params`` (same names, dtypes and shapes as ``like``) as
        the next version, and return the version the daemon gave it, once
        readers can see it (every publish waits for the daemon: ``flush``
        is kept for older callers).  Only the board's creator and the
        daemon's admins may publish (PermissionDenied)."""
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
        if self._lease is None:
            self._lease = self.table.lease()
        lease = self._lease
        lease.begin()
        slot, stamp = lease.run(self._write, lease, blob)
        self.table.client.flush(keep_leases=True)  # the commit applied: the item has its number
        m = self.table.mapped
        version = int(m.seqno[slot])
        if int(m.gens[slot]) != stamp or m.state[slot] != COMMITTED:  # already replaced (another publisher)
            newest = self._read_direct()
            version = self.version if newest in (None, _TORN) else newest[0]
        self.version = max(self.version, version)
        return version

    def _write(self, lease, blob) -> tuple[int, int]:
        """Copy one version into a reserved slot and commit it; returns the
        slot and its stamp (bumped by the reservation).  Run again after a
        reconnect (``lease.run``), with the rows as mapped then."""
        if not lease.views["blob"].flags.writeable:  # rows group read-only: not its creator
            raise PermissionDenied(f"board {self.table.name!r} is published only by its creator (uid "
                                   f"{self.table.spec.writer_uid}) and the daemon's admins; you are uid "
                                   f"{os.geteuid()}")
        rid, pos, slot = lease.take(None)
        stamp = int(self.table.mapped.gens[slot])
        views = lease.views
        views["layout"][slot] = self.layout
        views["blob"][slot] = blob
        lease.commit(rid, pos, None)
        return slot, stamp

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
        seen = t.inserts
        got = self._read(timeout)
        if got is None:
            return None
        version, layout = got
        self._seen_inserts = seen
        if layout != self.layout:
            raise FieldError(f"board {t.name!r}: version {version} was published with another "
                             "model (names, dtypes or shapes differ from like=)")
        if newer_than is not None and version <= newer_than:
            return None
        self.version = max(self.version, version)
        blob = self._buf
        return version, {e.name: blob[e.offset:e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
                         for e in self.entries}

    def _read(self, timeout: float):
        """(version, layout) of the newest whole version, copied into the
        buffer; None if there is none (after ``timeout``)."""
        for attempt in range(READ_TRIES):
            got = self._read_direct()
            if got is None and self.table.inserts == 0:
                break  # never published: nothing to wait for here
            if got is not None and got is not _TORN:
                return got
            # torn by a publish, or nothing committed for a moment (a
            # sampler's pin made a publish evict both slots): again, after a pause
            self.rereads += got is _TORN
            time.sleep(min(PAUSE_S[1], PAUSE_S[0] * 2**attempt))
        if got is None and timeout == 0.0:
            return None
        return self._read_sampled(timeout)  # waits in the daemon for a first one, or a pinned copy

    def _read_direct(self):
        """One copy of the newest committed item, straight from shared
        memory: (version, layout), None if nothing is committed, or _TORN
        if its slot was reserved again during the copy."""
        m = self.table.mapped
        state, seqno, gens = m.state, m.seqno, m.gens
        committed = np.flatnonzero(state == COMMITTED)
        if committed.shape[0] == 0:
            return None
        slot = int(committed[np.argmax(seqno[committed])])
        stamp = int(gens[slot])  # first: a reservation bumps it before anyone writes the slot
        if state[slot] != COMMITTED:
            return _TORN
        version = int(seqno[slot])
        layout = int(m.fields["layout"][slot])
        _copy(self._buf, m.fields["blob"][slot])
        if int(gens[slot]) != stamp or state[slot] != COMMITTED or int(seqno[slot]) != version:
            return _TORN
        return version, layout

    def _read_sampled(self, timeout: float):
        """The newest item as a one-item sample (the daemon waits up to
        ``timeout`` for one, and pins the slot for a second copy if a
        publish tore the first): (version, layout), or None."""
        t = self.table
        for _ in range(READ_TRIES):
            try:
                b = t.sample(1, out=self._out, timeout=timeout)
            except (EmptyTable, RateLimited):
                if len(t) == 0:
                    return None
                raise
            self._out = b
            self.rereads += b.redraws
            key = int(b.keys[0])
            slot, stamp = key & 0xFFFFFFFF, key >> 32
            m = t.mapped
            version = int(m.seqno[slot])
            if int(m.gens[slot]) == stamp:  # the number is still the copied item's
                np.copyto(self._buf, b.data["blob"][0])
                return version, int(b.data["layout"][0])
            self.rereads += 1
        raise ReplayTimeout(f"board {t.name!r}: no whole version read in {READ_TRIES} tries; the "
                            "publisher replaces versions faster than a reader copies one: give the "
                            "board more slots")


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """A reader's copy of a version's bytes (looked up at each read: a
    test swaps it to publish in the middle of a copy)."""
    np.copyto(dst, src)


def _check_publisher(table, publisher) -> None:
    """Refuse a board whose writer this reader does not trust: its own
    user, root, the daemon's user (the owner of the board's meta segment,
    which only the daemon makes), or ``publisher`` (a uid or user name)."""
    writer = table.spec.writer_uid
    trusted = {os.geteuid(), 0, os.stat(SHM_DIR + table.mapped.meta.name).st_uid}
    if publisher is not None:
        try:
            trusted.add(publisher if isinstance(publisher, int) else pwd.getpwnam(publisher).pw_uid)
        except KeyError:
            raise ReplayError(f"publisher={publisher!r}: no such user") from None
    if writer not in trusted:
        raise PermissionDenied(
            f"board {table.name!r} is published by uid {writer}, not by you, root or the daemon's "
            f"user; if you trust that user, attach with publisher={writer}")
