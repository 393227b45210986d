"""What the ingest owes each producer: which of its chunks the daemon
vouched for, and which it must send again.

Each chunk a producer sends carries a sequence number.  A chunk the ingest
accepted is *unflushed* until the next flush, then *acked* (vouched for)
or, if the flush could not vouch for it, *lost* (the producer sends it
again); acked and lost numbers wait until the producer's next answer.

Who calls it: the ingest (ingest.py), under its lock, one call at a time.
"""

from __future__ import annotations

import time


class Dues:
    def __init__(self, forget_s: float):
        self.unflushed: dict[str, list[int]] = {}  # producer -> seqs accepted since the last flush
        self.acked: dict[str, list[int]] = {}      # producer -> seqs flushed, not yet told
        self.lost: dict[str, list[int]] = {}       # producer -> seqs to send again, not yet told
        self.seen: dict[str, float] = {}           # producer -> when it was last answered
        self.forget_s = forget_s
        self.forgotten = 0                         # producers whose dues were dropped
        self.calling = None                        # the producer whose call runs now: never forgotten

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

    def answer(self, producer: str) -> tuple[list, list]:
        """(acked, lost) for ``producer``, told now."""
        self.seen[producer] = time.monotonic()
        return self.acked.pop(producer, []), self.lost.pop(producer, [])

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
