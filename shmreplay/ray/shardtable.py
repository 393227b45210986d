"""``ShardedTable``: one logical table over shards, each an ordinary table
in the daemon of one Ray node (shardhost.py), sampled as one table of
their union (sharddraws.py).

    shards = sray.start_shards(node_ids)            # a daemon per node
    t = sray.ShardedTable.create(shards, "replay", capacity=300_000, fields=fields)
    w = t.writer()            # in any Ray actor: local shard first, else round robin
    b = t.sample(256)         # a ShardBatch: rows, keys, P(i), weights, shards
    t.update_priorities(b.keys, new_p, b.shards)

* ``capacity`` is the whole table's: each shard holds ``ceil(capacity /
  N)`` items and evicts by its own remover.  Every other setting (sampler,
  alpha, remover, ``max_times_sampled``, rate limits, ``storage_dir``,
  ``writers``) is each shard's, as a local table's: a shard's box keeps
  every local guarantee (crash re-adoption, checkpoints, access rules).
* Rate limits are per shard: ``samples_per_insert`` holds for each
  shard's own inserts and samples, and so for their sums; a learner's
  draw waits in a shard whose limiter holds it back (up to ``timeout``),
  so a shard whose writers lag holds the whole batch back, as it would
  on one table.  ``min_size_to_sample`` counts a shard's own items.
* A queue (``create_queue``) delivers each item to one learner: each
  shard's table removes an item at its one sample; a batch is split by
  the shards' ready items, no order across shards (each shard keeps its
  own fifo).  Rows a batch got before another shard's limit timed out are
  not dropped: they start the next batch.
* Shards out of service are left out of a batch and said so in it
  (``ShardBatch.missing``, ``mass_left_out``); ``stats()["lost"]`` names
  shards whose node is gone for good and what they held.  So is a shard
  whose daemon does not answer a call within ``shard_timeout`` seconds
  (20 by default; past a draw's own wait for items and limits): a hung
  box costs a batch that long, once, then the batch comes from the rest.

A ``ShardedTable`` pickles as its shards, name and ``shard_timeout``: a copy opens the table
anew wherever it is unpickled, with agents of its own.

Who calls it: one thread of a learner (``iterate``'s prefetch thread then
draws for it); ``writer()``'s writers are for one producer thread each.
"""

from __future__ import annotations

import math
import queue
import threading

import numpy as np
import ray

from ..errors import PermissionDenied, ReplayError
from ..schema import make_spec, spec_from_wire
from .sharddraws import ShardBatch, ShardDraws
from .shardagent import ANSWER_S
from .shardbook import ShardBook
from .shardupdates import ShardUpdates
from .shardwriter import ShardedWriter

JOIN_S = 5.0  # the longest close() waits for the prefetch thread's draw


class ShardedTable:
    def __init__(self, shards: list, name: str, seed=None, split: str = "mass",
                 shard_timeout: float = ANSWER_S, _book=None):
        """Open the table ``name`` over ``shards`` (``start_shards`` /
        ``attach_shards``); every shard must hold it with one definition.
        ``seed``: the split's random generator; ``split="in_turn"``: draw
        each shard's equal share instead, as Reverb's client does (for
        comparisons only: sharddraws.py); ``shard_timeout``: see the
        module docstring."""
        if not shards:
            raise ReplayError("a sharded table needs at least one shard")
        self.shards, self.name, self.shard_timeout = list(shards), name, _checked_timeout(shard_timeout)
        self.book = _book or ShardBook(self.shards, name, self.shard_timeout)  # create's: its agents made it
        try:
            specs = {i: d for i, d in self.book.call("describe").items()}
            bad = {i: d for i, d in specs.items() if isinstance(d, BaseException)}
            if bad and len(bad) == len(specs):
                raise next(iter(bad.values()))
            good = [spec_from_wire(d) for d in specs.values() if not isinstance(d, BaseException)]
            if any(s != good[0] for s in good[1:]):
                raise ReplayError(f"the shards hold different tables named {name!r}: drop them and create it anew")
        except BaseException:
            self.book.close()
            raise
        self.spec = good[0]
        self.book.bind(self.spec.fields)
        self.draws = ShardDraws(self.book, self.spec.fields, self.spec.sampler in ("fifo", "lifo"), seed, split)
        self.updates = ShardUpdates(self.book)
        self.drawing = threading.Lock()  # ShardDraws is one thread's at a time

    @classmethod
    def create(cls, shards: list, name: str, capacity: int, fields, sampler: str = "prioritized",
               alpha: float = 0.6, exist_ok: bool = False, seed=None, shard_timeout: float = ANSWER_S,
               **limits) -> "ShardedTable":
        """Make ``name`` on every shard (``Client.create_table``'s
        arguments; ``capacity``: the whole table's, see the module
        docstring) and open it."""
        per = _per_shard(capacity, shards)
        make_spec(name, per, fields, sampler, alpha, **limits)  # refused here, before any shard has it
        return cls._made(shards, name, dict(capacity=per, fields=fields, sampler=sampler, alpha=alpha,
                                            exist_ok=exist_ok, **limits), False, seed, shard_timeout)

    @classmethod
    def create_queue(cls, shards: list, name: str, capacity: int, fields, exist_ok: bool = False,
                     seed=None, shard_timeout: float = ANSWER_S) -> "ShardedTable":
        """A queue over the shards (``Client.create_queue`` on each): each
        item delivered to one learner."""
        per = _per_shard(capacity, shards)
        make_spec(name, per, fields, "fifo", remover="fifo", max_times_sampled=1, samples_per_insert=1.0,
                  error_buffer=(0.0, float(per)))
        return cls._made(shards, name, dict(capacity=per, fields=fields, exist_ok=exist_ok), True, seed,
                         shard_timeout)

    @classmethod
    def _made(cls, shards, name, kwargs, queue_, seed, shard_timeout):
        if not shards:
            raise ReplayError("a sharded table needs at least one shard")
        book = ShardBook(list(shards), name, _checked_timeout(shard_timeout))  # its agents make it, then serve it
        try:
            made = book.call("create", kwargs, queue_, timeout=120)
            failed = {i: r for i, r in made.items() if isinstance(r, BaseException)}
            if failed:
                raise next(iter(failed.values()))
        except BaseException:
            book.close()
            raise
        return cls(shards, name, seed, shard_timeout=shard_timeout, _book=book)

    def __reduce__(self):
        return (ShardedTable, (self.shards, self.name, None, "mass", self.shard_timeout))

    def __repr__(self) -> str:
        return f"<shmreplay.ray.ShardedTable {self.name!r} over {len(self.shards)} shards>"

    # ---- a learner's calls ----
    def sample(self, batch_size: int, beta: float = 0.4, out: ShardBatch | None = None,
               timeout: float | None = None) -> ShardBatch:
        """A batch drawn over the shards as from one table of their union
        (sharddraws.py); ``out``: an earlier batch of the same size to fill
        again; ``timeout``: the longest to wait for items and the shards'
        limits (None: as long as it takes)."""
        with self.drawing:  # after an iterate's close, its thread may still finish a draw
            if out is None or isinstance(out, ShardBatch):
                return self.draws.sample(batch_size, beta, out, timeout)
            got = self.draws.sample(batch_size, beta, _as_shard_batch(out), timeout)
        out.shards, out.missing, out.mass_left_out = got.shards, got.missing, got.mass_left_out
        return out

    def iterate(self, batch_size: int, beta: float = 0.4, prefetch: int = 2, timeout: float | None = None,
                check_reuse: bool = False, buffers=None):
        """Batches drawn ahead by a thread while the learner trains (each a
        new one: the caller may keep it, so ``check_reuse`` has nothing to
        check and is accepted only for ``Table.iterate``'s callers).
        ``buffers``: as ``Table.iterate``'s (``shmreplay.torch.iterate``
        passes tensors)."""
        return ShardBatches(self, batch_size, beta, prefetch, timeout, buffers)

    def update_priorities(self, keys, priorities, shards) -> None:
        """New priorities for sampled keys, each to the shard it came from
        (``shards``: the batch's); keys replaced since are skipped."""
        self.updates.update(keys, priorities, shards)

    def flush(self) -> None:
        """Wait until every priority update sent so far is applied."""
        self.updates.settle()

    def writer(self, chunk: int = 64, in_flight: int = 2) -> ShardedWriter:
        """A writer for one producer (shardwriter.py says where rows go)."""
        return ShardedWriter(self.shards, self.name, chunk, in_flight)

    def __len__(self) -> int:
        """Items in the shards in service (a report from each)."""
        return sum(r.get("size", 0) for r in self.book.reports().values())

    @property
    def inserts(self) -> int:
        """Items inserted so far into the shards in service (a report from each)."""
        return sum(r.get("inserts", 0) for r in self.book.reports().values())

    def stats(self) -> dict:
        """Per shard: its node and its table's stats (or why it is out of
        service); in all: size, capacity, inserts, samples, the shards
        lost for good (``lost``: node, why, items it last held), priority
        updates lost with a shard."""
        got = self.book.call("stats")
        lost = dict(self.book.lost)  # the prefetch thread may add to it meanwhile
        shards = []
        for i, s in enumerate(self.shards):
            r = got.get(i)
            entry = {"node": s.node, "socket": s.socket}
            if i in lost:
                entry["lost"] = lost[i]
            elif isinstance(r, BaseException) or r is None:
                entry["down"] = str(r)
            else:
                entry.update(r)
            shards.append(entry)
        live = [e for e in shards if "size" in e]
        return {"name": self.name, "shards": shards,
                "size": sum(e["size"] for e in live), "capacity": sum(e["capacity"] for e in live),
                "inserts": sum(e["inserts"] for e in live), "samples": sum(e["samples"] for e in live),
                "lost": {i: dict(v) for i, v in lost.items()},
                "items_lost": sum(v["items"] for v in lost.values()),
                "updates_lost": self.updates.lost}

    def checkpoint(self, to: str) -> dict:
        """A checkpoint of each shard's table into ``to`` on its own node:
        shard -> what its daemon wrote (or why it could not: a shard out of
        service).  PermissionDenied when a shard's daemon refuses this user
        (a checkpoint is its admins')."""
        got = self.book.call("checkpoint", to)
        denied = [r for _, r in sorted(got.items()) if isinstance(r, PermissionDenied)]
        if denied:
            raise denied[0]
        return {i: (str(r) if isinstance(r, BaseException) else r) for i, r in got.items()}

    def drop(self) -> None:
        """Drop the table on every shard in service and stop their ingests.
        A shard that refuses (PermissionDenied: a drop is its daemon's
        admins') or cannot (out of service) raises, saying which shards
        dropped it; the table stays open, to drop again."""
        got = self.book.call("drop")
        failed = sorted((i, r) for i, r in got.items() if isinstance(r, BaseException))
        if failed:
            i, exc = failed[0]
            done = sorted(set(got) - {j for j, _ in failed})
            why = (f"drop of table {self.name!r}: shard {i} refused: {exc} (dropped on shards {done}; "
                   "drop again once every shard serves you)")
            try:
                again = type(exc)(why)
            except Exception:
                again = ReplayError(why)
            raise again from exc
        for i, s in enumerate(self.shards):
            if i not in self.book.lost:
                try:
                    ray.get(s.host.forget.remote(self.name), timeout=60)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass
        self.close()

    def close(self) -> None:
        """Stop this learner's agents (the tables stay)."""
        self.updates.close()
        self.book.close()

    def __enter__(self) -> "ShardedTable":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checked_timeout(t) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ReplayError(f"shard_timeout must be a number of seconds > 0, got {t!r}")
    return float(t)


def _per_shard(capacity, shards) -> int:
    """Each shard's capacity: the whole table's over the shards, rounded
    up (anything else is left for ``make_spec`` to refuse, naming it)."""
    if isinstance(capacity, (int, np.integer)) and not isinstance(capacity, bool) and shards:
        return math.ceil(int(capacity) / len(shards))
    return capacity


class ShardBatches:
    """``ShardedTable.iterate``: a thread draws up to ``prefetch`` batches
    ahead into a queue; ``close()`` (or the ``with`` block) stops it."""

    def __init__(self, table: ShardedTable, n: int, beta: float, prefetch: int, timeout, buffers):
        if prefetch < 1:
            raise ReplayError(f"prefetch must be >= 1, got {prefetch}")
        self.table, self.n, self.beta, self.timeout, self.buffers = table, n, beta, timeout, buffers
        self.ready: queue.Queue = queue.Queue(prefetch)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                box = self.buffers() if self.buffers is not None else None
                batch = self.table.sample(self.n, self.beta, None if box is None else box.batch, self.timeout)
                item = (box if box is not None else batch, None)
            except BaseException as exc:  # handed to the learner's thread
                item = (None, exc)
            while not self.stop.is_set():
                try:
                    self.ready.put(item, timeout=0.25)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            batch = self.next_within(0.25)
            if batch is not None:
                return batch

    def next_within(self, timeout: float):
        """The next batch, or None if none came within ``timeout`` s (a
        loop that does other work while the actors fill the shards)."""
        if self.stop.is_set():
            raise StopIteration
        try:
            batch, exc = self.ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if exc is not None:
            self.close()
            raise exc
        return batch

    def close(self) -> None:
        self.stop.set()
        if self.thread is not threading.current_thread():
            # a draw waiting in a shard's limits may hold the thread: it
            # is a daemon thread, left to end with its draw
            self.thread.join(JOIN_S)

    def __enter__(self) -> "ShardBatches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_shard_batch(b) -> ShardBatch:
    """A plain ``SampleBatch`` (``shmreplay.torch``'s tensors' one) as a
    ShardBatch over the same arrays, with a shards array of its own."""
    return ShardBatch(b.data, b.keys, b.probabilities, b.weights, shards=np.empty(len(b), np.int32))
