"""``RemoteWriter``: rows from a producer anywhere on the cluster, in
chunks, to an ingest (ingest.py), with bounded calls in flight and chunks
kept until confirmed (the package docstring says what that promises).

Who calls it: one thread of a producer (a writer is not thread-safe).
"""

from __future__ import annotations

import collections
import time

import numpy as np
import ray

from ..errors import DaemonUnavailable, ReplayError, ReservationExpired
from .producers import check_key, new_key, shown_id
from .packing import layout_id, pack, row_dtype

# an ingest call failed for one of these may succeed if sent again
_RETRIABLE = (DaemonUnavailable, ReservationExpired)


class ChunkRefused(ReplayError):
    """The ingest could not insert a chunk: the reason is the table's or the daemon's."""


class RemoteWriter:
    """Rows from a remote producer, in chunks, with at most ``in_flight``
    ingest calls unanswered and at most ``hold`` chunks inserted but not yet
    confirmed flushed, which it keeps to send again (see the module
    docstring): at most ``in_flight + hold`` chunks of it are outside the
    table's vouched-for rows at any time."""

    def __init__(self, ingest, chunk: int = 64, in_flight: int = 2, retries: int = 10, hold: int = 16, *,
                 key: str | None = None):
        """``key``: this producer's secret (``producers.new_key()``), drawn here
        when None; whoever holds it may claim the producer's sequence
        numbers, so give one only where it stays as secret (the tests give
        one to play a party that stole it)."""
        for name, v in (("chunk", chunk), ("in_flight", in_flight), ("hold", hold)):
            if not isinstance(v, int) or v < 1:
                raise ReplayError(f"{name} must be an int >= 1, got {v!r}")
        self.ingest, self.chunk, self.in_flight, self.retries, self.hold = ingest, chunk, in_flight, retries, hold
        # the ingest keeps this writer's sequence numbers by a secret key
        # (producers.py); ``id``, a digest of it, is all that is ever shown
        self._key = new_key() if key is None else check_key(key)
        self.id = shown_id(self._key)
        self._rows: dict[str, list] = {}
        self._prios: list = []
        self._seq = 0
        self._calls: collections.deque = collections.deque()  # [ref, seq, part, prios, attempts], unanswered
        self._held: dict = {}  # seq -> [part, prios, attempts, incarnation]: inserted, not yet flushed
        self._again: collections.deque = collections.deque()  # (seq, part, prios, attempts) to send again
        self._incarnation = None  # the ingest's, as of its last answer
        self._asking = None  # the seq of the call in flight that asks the ingest to flush
        self._row = None  # the table's packed row (packing.py), asked of the ingest at the first chunk
        self._layout = None  # its fingerprint, sent with each packed chunk
        self.sent = self.confirmed = self.resent = 0

    def insert(self, priority=None, **fields) -> None:
        """One row (the table's fields); ``priority=None``: the table's max."""
        if self._rows and fields.keys() != self._rows.keys():
            raise ReplayError(f"a row needs the fields {sorted(self._rows)}, got {sorted(fields)}")
        if (priority is None) != (not self._prios) and self._count():
            raise ReplayError("give a priority for every row of a chunk or for none")
        for k, v in fields.items():  # a copy: the caller may reuse its buffers (an env's obs)
            self._rows.setdefault(k, []).append(np.array(v))
        if priority is not None:
            self._prios.append(float(priority))
        if self._count() >= self.chunk:
            self._send()

    def insert_batch(self, data: dict, priorities=None) -> None:
        """Rows with a leading dimension, sent in chunks of at most ``chunk``."""
        n = len(next(iter(data.values())))
        for lo in range(0, n, self.chunk):
            self._flush_rows()
            part = {k: np.ascontiguousarray(v[lo:lo + self.chunk]) for k, v in data.items()}
            self._submit(part, None if priorities is None else np.asarray(priorities[lo:lo + self.chunk]))

    def flush(self) -> None:
        """Send what is buffered and wait until every chunk is confirmed:
        inserted and flushed (vouched for by the daemon)."""
        self._flush_rows()
        while True:  # each round confirms, re-sends (attempts bounded) or raises
            self._send_again()
            while self._calls:
                self._answer_oldest()
                self._send_again()
            if self._held:
                self._sync()
            elif not self._again:
                return

    @property
    def unconfirmed(self) -> int:
        """Chunks made and not yet confirmed: at most ``in_flight + hold``,
        and one more waiting for room."""
        return len(self._calls) + len(self._held) + len(self._again)

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "RemoteWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()

    # ---- internals ----
    def _count(self) -> int:
        return len(next(iter(self._rows.values()))) if self._rows else 0

    def _flush_rows(self) -> None:
        if self._count():
            self._send()

    def _send(self) -> None:
        part = {k: np.stack(v) for k, v in self._rows.items()}
        prios = np.asarray(self._prios) if self._prios else None
        self._rows, self._prios = {}, []
        self._submit(part, prios)

    def _submit(self, part: dict, prios) -> None:
        if self._row is None:
            try:
                self._row = row_dtype(ray.get(self.ingest.fields.remote()))
                self._layout = layout_id(self._row)
            except ray.exceptions.RayActorError:
                pass  # restarting: this chunk goes unpacked, the next one asks again
            except Exception:  # not an ingest of this version: chunks go unpacked
                self._row = False
        packed = pack(part, self._row) if isinstance(self._row, np.dtype) else None
        if packed is not None:
            part = packed  # the wire form, sent again as it is
        self._seq += 1
        self.sent += 1
        # queued first: if waiting for room raises (another chunk refused),
        # this one is still queued, and the next send or flush sends it
        self._again.append((self._seq, part, prios, 0))
        self._send_again()

    def _call(self, seq: int, part: dict, prios, attempts: int) -> None:
        while len(self._calls) >= self.in_flight:  # back-pressure: wait for the oldest
            self._answer_oldest()
        # past ``hold`` chunks not yet vouched for, ask the ingest to flush
        # with this one (once: that flush covers every call before it)
        sync = self._asking is None and len(self._held) + len(self._calls) + 1 >= self.hold
        if sync:
            self._asking = seq
        # the rest as one list: Ray packs plain values in a list with msgpack
        # and pickles a tuple (Ingest.put)
        layout = self._layout if isinstance(part, np.ndarray) else None
        self._calls.append([self.ingest.put.remote(part, [prios, self._key, seq, sync, layout]), seq, part, prios,
                            attempts])

    def _send_again(self) -> None:
        while self._again:
            seq, part, prios, attempts = self._again[0]
            self._call(seq, part, prios, attempts)  # may raise for another chunk: this one stays queued
            self._again.popleft()
            self.resent += attempts > 0

    def _answer_oldest(self) -> None:
        ref, seq, part, prios, attempts = self._calls[0]  # still counted while it is awaited
        if seq == self._asking:
            self._asking = None
        try:
            _, acked, lost, incarnation = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the ingest died: Ray restarts it
            self._again_later(seq, part, prios, attempts, exc, pause=True)
            return
        except ray.exceptions.RayTaskError as exc:
            if not isinstance(exc.cause, _RETRIABLE):
                raise ChunkRefused(f"the ingest refused a chunk: {exc.cause!r}") from None
            # the daemon went away (the ingest's client reconnects meanwhile:
            # give it time), or the ingest's lease was void (renewed already)
            self._again_later(seq, part, prios, attempts, exc.cause,
                              pause=not isinstance(exc.cause, ReservationExpired))
            return
        finally:
            self._calls.popleft()
        self._held[seq] = [part, prios, attempts, incarnation]
        self._settle(acked, lost, incarnation)

    def _sync(self) -> None:
        """Ask the ingest to flush; every held chunk is then confirmed or sent again."""
        why = None
        for attempt in range(1, self.retries + 2):
            try:
                _, acked, lost, incarnation = ray.get(self.ingest.sync.remote(self._key))
                break
            except ray.exceptions.RayActorError as exc:
                why = exc
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, _RETRIABLE):
                    raise ChunkRefused(f"the ingest could not flush: {exc.cause!r}") from None
                why = exc.cause
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
        else:
            raise ChunkRefused(f"the ingest could not flush in {self.retries} attempts: {why!r}")
        self._settle(acked, lost, incarnation)
        # after a flush the ingest owes nothing: a chunk still held was lost
        # with a state it no longer has, so it goes again (never a hang)
        self._settle([], list(self._held), incarnation)

    def _settle(self, acked, lost, incarnation) -> None:
        if incarnation != self._incarnation:
            # a restarted ingest: what the old one had not flushed may be gone
            # with it.  Decided before any ack is read: a new incarnation's
            # ack of a sequence number vouches for what *it* accepted under
            # that number, never for a chunk an earlier one answered
            lost = list(lost) + [s for s, h in self._held.items() if h[3] != incarnation]
            self._incarnation = incarnation
        for s in acked:
            h = self._held.get(s)
            if h is not None and h[3] == incarnation:  # answered by the incarnation that vouches for it
                del self._held[s]
                self.confirmed += 1
        for s in lost:
            h = self._held.pop(s, None)
            if h is not None:
                self._again_later(s, h[0], h[1], h[2], "a daemon restart may have lost it", pause=False)

    def _again_later(self, seq, part, prios, attempts, why, pause: bool) -> None:
        attempts += 1
        if attempts > self.retries:
            raise ChunkRefused(f"a chunk could not be delivered in {self.retries} attempts: {why!r}")
        if pause:
            time.sleep(min(2.0, 0.1 * 2 ** attempts))  # give Ray time to restart the ingest
        self._again.append((seq, part, prios, attempts))
