"""Rate limiting: when an insert or a sample may proceed.

Reverb's SampleToInsertRatio, over counters the daemon keeps per table::

    diff = inserts * samples_per_insert - samples

* a sample of n may run once the table holds ``min_size_to_sample`` items
  and ``diff - n >= min_diff``;
* an insert of k may run while ``size + k <= min_size_to_sample`` (filling
  up is free), or else if ``(inserts + k) * samples_per_insert - samples <=
  max_diff``.

Slots a writer has reserved but not committed count as inserts here
(``pending``): the limiter admits inserts at RESERVE, before the rows are
written, so a writer cannot overshoot the ratio by filling slots it holds.
A sample batch is admitted whole, never part of it: a batch that times out
has taken nothing from the table (no queue item is lost).

Pure functions of the counters, shared by the daemon (which decides) and the
client (``can_insert``/``can_sample`` probes read the same counters from the
segment's live words).  Who may call: anyone; they touch no state.
"""

from __future__ import annotations

import math

from .schema import TableSpec

# slack for float error in the ratio bounds (samples_per_insert = 0.1 etc.)
_EPS = 1e-9


def insert_room(spec: TableSpec, size: int, inserts: int, pending: int, samples: int,
                want: int) -> int:
    """How many of ``want`` inserts the limiter admits now (0..want)."""
    if spec.samples_per_insert is None:
        return want
    by_size = spec.min_size_to_sample - (size + pending)
    _, hi = spec.diff_bounds
    by_ratio = math.floor((hi + samples) / spec.samples_per_insert - (inserts + pending) + _EPS)
    return max(0, min(want, max(by_size, by_ratio)))


def sample_blocker(spec: TableSpec, size: int, inserts: int, samples: int, n: int) -> str | None:
    """None if a sample of n may run now, else why not (for the error message)."""
    if size < spec.min_size_to_sample:
        return (f"the table holds {size} items, fewer than min_size_to_sample "
                f"{spec.min_size_to_sample}")
    if spec.samples_per_insert is None:
        return None
    lo, _ = spec.diff_bounds
    diff = inserts * spec.samples_per_insert - samples
    if diff - n < lo - _EPS:
        return (f"samples_per_insert {spec.samples_per_insert:g}: {samples} samples after "
                f"{inserts} inserts, and {n} more would take inserts*samples_per_insert - samples "
                f"to {diff - n:g}, below min_diff {lo:g}; waiting for inserts")
    return None


def insert_blocker(spec: TableSpec, inserts: int, pending: int, samples: int) -> str:
    """Why an insert is held (call when insert_room() returned 0)."""
    _, hi = spec.diff_bounds
    return (f"samples_per_insert {spec.samples_per_insert:g}: {inserts} inserts (+{pending} "
            f"reserved) and {samples} samples; one more insert would take "
            f"inserts*samples_per_insert - samples above max_diff {hi:g}; waiting for samples")


def max_sample_batch(spec: TableSpec) -> int | None:
    """The largest batch the limiter can ever admit whole, or None for no bound.

    Inserts stop once diff would pass max_diff, and a batch of n needs
    ``diff >= min_diff + n``, so no batch over ``max_diff - min_diff`` can
    ever run (Reverb admits items one at a time; we admit batches whole)."""
    if spec.samples_per_insert is None:
        return None
    lo, hi = spec.diff_bounds
    return int(math.floor(hi - lo + _EPS))


def restored_samples(spec: TableSpec, inserts: int, samples: int, can_sample: bool) -> int:
    """The samples counter a table restarts with (crash recovery, checkpoint
    restore), given the counters it saved and whether its restored items can
    be sampled at all (``can_sample``: enough items, uses left, mass > 0).

    Saved counters may not match the restored items: a checkpoint drops items
    evicted while it was written, a crash can cut a commit short.  Taken as
    they are, the limiter can then hold both sides for ever (Reverb issue
    #103: samples wait for inserts, inserts wait for samples that the
    restored items cannot give).  So ``diff`` is moved into [min_diff,
    max_diff], and if nothing can be sampled, low enough that an insert is
    admitted.  With the error buffer at least 2 * max(1, samples_per_insert)
    wide (schema._check_limits), one of the two can then always run."""
    if spec.samples_per_insert is None:
        return samples
    spi = spec.samples_per_insert
    lo, hi = spec.diff_bounds
    diff = inserts * spi - samples
    top = hi if can_sample else hi - spi
    diff = min(max(diff, lo), top)
    # samples is an integer: round, then keep diff inside [lo, top] (the
    # interval is >= 1 wide); below 0 only while fewer than min_size_to_sample
    # items were ever inserted, where inserts are admitted anyway
    s = round(inserts * spi - diff)
    s = max(s, math.ceil(inserts * spi - top - _EPS))
    s = min(s, math.floor(inserts * spi - lo + _EPS))
    return max(0, int(s))
