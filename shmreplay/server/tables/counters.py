"""The counters a table's limits decide by, and their mirror in the segment.

Reverb's rate limiter reads inserts, samples and the table size; the reuse
limit (``max_times_sampled``) reads how many samples the committed items can
still give.  The decisions themselves are the pure functions of
``ratelimiter`` (shared with clients, whose ``can_insert``/``can_sample``
read the same counters from the segment's live words); this class keeps
the numbers, says why a request must wait, and publishes the live words.

Engine thread only.
"""

from __future__ import annotations

from ... import ratelimiter  # the shared predicates
from ...errors import CapacityError, EmptyTable, RateLimited, ReplayError
from ...schema import TableSpec
from ...wire.livewords import LiveWords


class LimiterCounters:
    def __init__(self, spec: TableSpec, words: LiveWords):
        self.spec = spec
        self.words = words
        self.size = 0       # committed items
        self.inserts = 0    # items committed since creation
        self.samples = 0    # items handed out since creation
        self.deletes = 0    # items that left (evicted, or sampled for the last time)
        self.uses_left = 0  # samples the committed items can still give (max_times_sampled)

    def insert_room(self, pending: int, n: int) -> int:
        """How many of n inserts the limiter admits now; slots reserved and
        not committed (``pending``) count as inserts already."""
        return ratelimiter.insert_room(self.spec, self.size, self.inserts, pending, self.samples, n)

    def insert_refusal(self, pending: int) -> RateLimited:
        return RateLimited(f"insert into table {self.spec.name!r} timed out: "
                           + ratelimiter.insert_blocker(self.spec, self.inserts, pending, self.samples))

    def check_sample(self, n: int) -> None:
        """Refuse, at once, samples that could never run: a batch larger
        than the limits can ever admit.  (The batch size's range and beta
        are the record's to check: ``records.check_draw``.)"""
        spec = self.spec
        top = ratelimiter.max_sample_batch(spec)
        if top is not None and n > top:
            raise CapacityError(
                f"table {spec.name!r}: a batch of {n} can never be admitted: its error buffer "
                f"[{spec.diff_bounds[0]:g}, {spec.diff_bounds[1]:g}] admits at most {top} "
                "samples at once; sample smaller batches or widen error_buffer")
        mts = spec.max_times_sampled
        if mts and n > mts * spec.capacity:
            raise CapacityError(
                f"table {spec.name!r}: a batch of {n} exceeds capacity {spec.capacity} x "
                f"max_times_sampled {mts}, the most samples the table can ever hold at once")

    def sample_refusal(self, n: int, mass: float) -> ReplayError | None:
        """None if a sample of n may run now, else the error it gets if it
        still may not when its time runs out."""
        spec, name = self.spec, self.spec.name
        why = ratelimiter.sample_blocker(spec, self.size, self.inserts, self.samples, n)
        if why is None and spec.max_times_sampled and self.uses_left < n:
            why = (f"its items can give only {self.uses_left} more samples "
                   f"(max_times_sampled {spec.max_times_sampled}), fewer than {n}")
        if why is None and not mass > 0:
            why = "no item has a positive priority"
        if why is None:
            return None
        if self.size == 0 or not mass > 0:
            return EmptyTable(f"table {name!r} has no sampleable items ({self.size} committed): {why}")
        return RateLimited(f"sample of {n} from table {name!r} timed out: {why}")

    def committed(self, n: int) -> None:
        self.size += n
        self.inserts += n
        self.uses_left += n * self.spec.max_times_sampled

    def removed(self, n: int, uses_left: int) -> None:
        """n items left the table with ``uses_left`` samples unused between them."""
        self.size -= n
        self.deletes += n
        self.uses_left -= uses_left

    def sampled(self, n: int) -> None:
        self.samples += n
        if self.spec.max_times_sampled:
            self.uses_left -= n

    def restore(self, size: int, uses_left: int, can_sample: bool) -> None:
        """Recovery: counters from a segment a dead daemon (or a checkpoint)
        left, made consistent with the items actually restored
        (``ratelimiter.restored_samples``)."""
        w = self.words
        self.size = size
        self.uses_left = uses_left
        self.inserts = max(w.inserts, size)
        self.deletes = w.deletes
        self.samples = ratelimiter.restored_samples(self.spec, self.inserts, w.samples, can_sample)

    def publish(self, pending: int, free: int, mass: float, least: float) -> None:
        self.words.publish(self.size, self.inserts, pending, self.samples, self.deletes, free,
                           self.uses_left, mass, least)

    def snapshot(self, pending: int) -> dict:
        return {"inserts": self.inserts, "samples": self.samples, "deletes": self.deletes,
                "pending": pending, "uses_left": self.uses_left}


class Blocked(Exception):
    """A request cannot run now but may later (the engine parks it).
    ``error`` is what the client gets if it is still blocked when its
    timeout runs out."""

    def __init__(self, error: ReplayError):
        super().__init__(str(error))
        self.error = error
