"""The ingest's producers: each one's secret key, and what the ingest owes
it: which of its chunks the daemon vouched for, and which it must send
again.

Each chunk a producer sends carries a sequence number.  A chunk the ingest
accepted is *unflushed* until the next flush, then *acked* (vouched for)
or, if the flush could not vouch for it, *lost* (the producer sends it
again); acked and lost numbers wait until the producer's next answer.

Producers are known by a secret *key* each draws (``new_key``: 128 bits
from ``secrets``), sent with each of its calls; the books are kept by key, so
only a process that holds the key can claim a producer's sequence
numbers or collect what it is owed.  Stats and messages show only
``shown_id(key)``, a digest that does not give the key back.

Who calls it: the ingest (ingest.py), under its lock, one call at a time;
``new_key``, ``check_key`` and ``shown_id`` anyone.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
import uuid

from ..errors import ReplayError

KEY_BYTES = 16  # a producer's key: 128 random bits, as 32 hex digits
_KEY = re.compile(r"[0-9a-f]{%d}" % (2 * KEY_BYTES))


def new_key() -> str:
    """A producer's secret key."""
    return secrets.token_hex(KEY_BYTES)


def check_key(key) -> str:
    """``key`` if it is a well-formed producer key, else a ReplayError: a
    guessable name (``"p"``, a pid) would let others claim its chunks."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ReplayError(f"a producer's key must be {2 * KEY_BYTES} lowercase hex digits "
                          "(shmreplay.ray.producers.new_key(): 128 random bits), got another value: "
                          "send chunks through RemoteWriter, which draws one")
    return key


def check_call(key, seq) -> None:
    """A producer's call: a well-formed key, an int sequence number."""
    check_key(key)
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise ReplayError(f"a chunk's sequence number must be an int, got {type(seq).__name__}")


def shown_id(key: str) -> str:
    """What stats and logs show of a producer: 16 hex digits of the key's
    SHA-256.  Knowing it does not let anyone claim the producer's chunks."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ProducerBooks:
    """The ingest's books of its producers: what it owes each (sequence
    numbers unflushed, acked, lost), when each last called, and the
    ingest's incarnation, which every answer carries."""

    def __init__(self, forget_s: float):
        self.incarnation = uuid.uuid4().hex  # this ingest's, in every answer: a restart is a new one
        # producers by their secret key (check_key): never shown, see shown_id
        self.unflushed: dict[str, list[int]] = {}  # producer -> seqs accepted since the last flush
        self.acked: dict[str, list[int]] = {}      # producer -> seqs flushed, not yet told
        self.lost: dict[str, list[int]] = {}       # producer -> seqs to send again, not yet told
        self.seen: dict[str, float] = {}           # producer -> when it was last answered
        self.forget_s = forget_s
        self.forgotten = 0                         # producers dropped while owed something
        self.calling = None                        # the producer whose call runs now: never forgotten

    def shown(self) -> list[str]:
        """The producers known, as ``shown_id``: a key shown would let anyone claim its chunks."""
        return sorted(shown_id(k) for k in self.seen)

    def accept(self, producer: str, seq: int) -> None:
        self.unflushed.setdefault(producer, []).append(seq)

    def withdraw(self, producer, seq) -> None:
        """Take back an accepted chunk (its call raises: the producer sends it again or gives up)."""
        if producer is not None and seq in self.unflushed.get(producer, ()):
            self.unflushed[producer].remove(seq)

    @property
    def waiting(self) -> int:
        """Chunks accepted since the last flush."""
        return sum(map(len, self.unflushed.values()))

    def vouch(self) -> None:
        """A flush vouched for every chunk accepted since the last one."""
        self._forget_silent()  # first: the producers of chunks being vouched for are calling
        for p, seqs in self.unflushed.items():
            self.acked.setdefault(p, []).extend(seqs)
        self.unflushed.clear()

    def lose(self) -> None:
        """Nothing accepted since the last flush is vouched for: each is sent again."""
        for p, seqs in self.unflushed.items():
            self.lost.setdefault(p, []).extend(seqs)
        self.unflushed.clear()

    def answer(self, producer: str, rows: int) -> list:
        """What ``producer`` is told now of a call that took ``rows``:
        [rows, acked, lost, incarnation] (a list: see ``Ingest.put``)."""
        self.seen[producer] = time.monotonic()
        return [rows, self.acked.pop(producer, []), self.lost.pop(producer, []), self.incarnation]

    def _forget_silent(self) -> None:
        """Drop what is owed to producers silent for ``forget_s`` (a
        producer that died never collects it); ``forgotten`` counts those
        that were owed something.  One that only went quiet and comes back
        finds its held chunks unaccounted for at its next flush and sends
        them again (stored twice, never lost)."""
        now = time.monotonic()
        for p in [p for p, t in self.seen.items() if now - t > self.forget_s]:
            if p == self.calling or p in self.unflushed:  # calling now, or its chunk is being flushed
                continue
            del self.seen[p]
            owed = self.acked.pop(p, None), self.lost.pop(p, None)
            self.forgotten += owed != (None, None)
