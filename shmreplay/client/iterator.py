"""A learner's prefetching iterator: ``table.iterate(batch_size, beta, prefetch=2)``.

While the caller trains on batch k, a background thread has already sent
SAMPLE for batch k+1.. and gathered their rows, so the learner never waits
for a daemon that is queued behind actors for a CPU.  The thread has its own
connection (a ``Client`` is single-threaded); the caller keeps using its own
client, for ``update_priorities`` too.

Buffers rotate, and this is the contract: **a batch is valid until the
next ``next()``**.  ``prefetch + 1`` batches exist; when the caller asks
for batch k+1, batch k's buffers go back to the prefetch thread, which
gathers a later batch into them at once.  So copy what must outlive the
step (``b.data["obs"].copy()``, ``tensor.clone()``, a loss kept for
logging as ``loss.item()``): a tensor made with ``torch.from_numpy`` on
batch k, or an autograd graph that saved one, sees batch k+prefetch+1's
rows later.  ``check_reuse=True`` checks the contract (a debug mode, for a
test run of a training loop): a batch's buffers are recycled one step
late, and if anything outside the iterator still references one of their
arrays (or tensors) by then, ``next()`` raises ``ReplayError`` naming the
field, instead of overwriting it.  Priority updates made for batch k
reach the daemon while batches k+1..k+prefetch are already drawn: samples
are at most ``prefetch`` updates stale, the bound the asynchronous-update
literature uses.  Stop it with ``close()`` or a ``with`` block.

Threads: the caller's (``__next__``, ``close``) and the prefetch thread,
which alone uses the iterator's connection.  It uses only the table's
public and pipelined-draw API (``begin_sample``/``finish_sample``).
"""

from __future__ import annotations

import queue
import sys
import threading

from ..errors import RateLimited, ReplayError, ReplayTimeout
from .gather import gather_in_background

# with no timeout, the prefetch thread waits for the table's limits in slices
# of this length, so close() never waits on a request parked in the daemon
_POLL_S = 0.25


class BatchIterator:
    def __init__(self, table, batch_size: int, beta: float, prefetch: int,
                 timeout: float | None = None, buffers=None, check_reuse: bool = False):
        """``buffers``: None (numpy batches) or a function returning a new
        buffer object: its ``.batch`` is the ``SampleBatch`` rows are
        gathered into, ``.arrays()`` what a caller may keep a reference to
        (``shmreplay.torch``'s pinned tensors), and an optional
        ``.ready_for_refill()`` waits until it may be written again (an
        asynchronous device copy); the buffer object is what ``next()``
        returns."""
        if prefetch < 1:
            raise ReplayError(f"prefetch must be >= 1, got {prefetch}")
        owner = table.client
        # a batch may wait for the table's limits (timeout; None: no limit),
        # then for the reply
        self._wait_s = timeout
        self.timeout = None if timeout is None else timeout + owner.timeout
        self._join_s = owner.timeout + _POLL_S
        self._n, self._beta = int(batch_size), float(beta)
        self._check = bool(check_reuse)
        count = prefetch + 1 + self._check  # the check recycles a batch one step late
        # the buffers before the connection: one that cannot be made (pinned
        # memory without CUDA) must not leave a connection open behind the error
        self._buffers = [None if buffers is None else buffers() for _ in range(count)]
        self._batches = [None if b is None else b.batch for b in self._buffers]
        self._client = owner.clone()
        self._table = self._client.table(table.name)
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        for i in range(count):
            self._free.put(i)
        self._current: int | None = None
        self._outstanding: list = []  # check_reuse: (index, reference counts when handed out)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="shmreplay-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        # keep one SAMPLE in flight: send the request for the next batch,
        # then gather the current one while the daemon draws
        t, n, beta = self._table, self._n, self._beta
        gather_in_background()  # the caller trains meanwhile: leave it its core
        ahead = None
        try:
            while not self._stop.is_set():
                try:
                    i = self._free.get(timeout=0.1)
                except queue.Empty:
                    continue
                w = _POLL_S if self._wait_s is None else self._wait_s
                refill = getattr(self._buffers[i], "ready_for_refill", None)
                if refill is not None:
                    refill()  # e.g. a device copy still reading it
                while True:
                    seq = ahead if ahead is not None else t.begin_sample(n, beta, w)
                    ahead = t.begin_sample(n, beta, w)
                    try:
                        self._batches[i] = t.finish_sample(seq, n, beta, self._batches[i], w)
                        break
                    except RateLimited:
                        if self._wait_s is not None or self._stop.is_set():
                            raise
                self._ready.put(i)
        except BaseException as exc:  # handed to the caller's next()
            self._ready.put(exc)

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self):
        got = self.next_within(self.timeout)
        if got is None:
            raise ReplayTimeout(f"no prefetched batch within {self.timeout} s")
        return got

    def next_within(self, seconds: float | None):
        """The next batch, or None if none is ready within ``seconds`` (None:
        no limit); the prefetch thread goes on drawing it.  For a loop that
        looks at other things between bounded waits (``loops.py``); the
        batch handed out before is given back as by ``next()``."""
        if self._stop.is_set():
            raise StopIteration
        if self._current is not None:
            if self._check:
                self._recycle_checked()
            else:
                self._free.put(self._current)
            self._current = None
        try:
            item = self._ready.get(timeout=seconds)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._current = item
        if self._check:
            self._outstanding.append((item, self._references(item)))
        return self._handed(item)

    def _handed(self, i: int):
        return self._batches[i] if self._buffers[i] is None else self._buffers[i]

    def _arrays(self, i: int) -> dict:
        out = self._handed(i)
        if self._buffers[i] is None:
            return {**{f"data[{k!r}]": a for k, a in out.data.items()},
                    "keys": out.keys, "probabilities": out.probabilities, "weights": out.weights}
        return out.arrays()

    def _references(self, i: int) -> dict:
        return {name: sys.getrefcount(a) for name, a in self._arrays(i).items()}

    def _recycle_checked(self) -> None:
        """check_reuse: the batch handed out before the current one goes
        back now, unless something outside still references its arrays."""
        if len(self._outstanding) < 2:
            return
        i, counts = self._outstanding.pop(0)
        kept = [name for name, c in self._references(i).items() if c > counts[name]]
        if kept:
            self.close()
            raise ReplayError(
                f"check_reuse: the batch handed out two steps ago is still referenced "
                f"({', '.join(kept)}); its buffers are about to be refilled.  A batch is valid "
                "until the next next(): copy what must outlive it (.copy(), tensor.clone(), "
                "loss.item())")
        self._free.put(i)

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(self._join_s)
        self._thread = None
        self._client.close()

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
