"""A learner's prefetching iterator: ``table.iterate(batch_size, beta, prefetch=2)``.

While the caller trains on batch k, a background thread has already sent
SAMPLE for batch k+1.. and gathered their rows, so the learner never waits
for a daemon that is queued behind actors for a CPU.  The thread has its own
connection (a ``Client`` is single-threaded); the caller keeps using its own
client, for ``update_priorities`` too.

Buffers rotate: ``prefetch + 1`` batches exist, and the batch handed out is
reused once the caller asks for the batch after the next ``prefetch`` ones,
so keep (copy) what must outlive that.  Priority updates made for batch k
reach the daemon while batches k+1..k+prefetch are already drawn: samples
are at most ``prefetch`` updates stale, the bound the asynchronous-update
literature uses.  Stop it with ``close()`` or a ``with`` block.

Threads: the caller's (``__next__``, ``close``) and the prefetch thread,
which alone uses the iterator's connection.  It uses only the table's
public and pipelined-draw API (``begin_sample``/``finish_sample``).
"""

from __future__ import annotations

import queue
import threading

from ..errors import RateLimited, ReplayError, ReplayTimeout

# with no timeout, the prefetch thread waits for the table's limits in slices
# of this length, so close() never waits on a request parked in the daemon
_POLL_S = 0.25


class BatchIterator:
    def __init__(self, table, batch_size: int, beta: float, prefetch: int,
                 timeout: float | None = None):
        if prefetch < 1:
            raise ReplayError(f"prefetch must be >= 1, got {prefetch}")
        owner = table.client
        # a batch may wait for the table's limits (timeout; None: no limit),
        # then for the reply
        self._wait_s = timeout
        self.timeout = None if timeout is None else timeout + owner.timeout
        self._join_s = owner.timeout + _POLL_S
        self._client = owner.clone()
        self._table = self._client.table(table.name)
        self._n, self._beta = int(batch_size), float(beta)
        self._batches = [None] * (prefetch + 1)
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        for i in range(prefetch + 1):
            self._free.put(i)
        self._current: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="shmreplay-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        # keep one SAMPLE in flight: send the request for the next batch,
        # then gather the current one while the daemon draws
        t, n, beta = self._table, self._n, self._beta
        ahead = None
        try:
            while not self._stop.is_set():
                try:
                    i = self._free.get(timeout=0.1)
                except queue.Empty:
                    continue
                w = _POLL_S if self._wait_s is None else self._wait_s
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
        if self._stop.is_set():
            raise StopIteration
        if self._current is not None:
            self._free.put(self._current)
            self._current = None
        try:
            item = self._ready.get(timeout=self.timeout)
        except queue.Empty:
            raise ReplayTimeout(f"no prefetched batch within {self.timeout} s") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._current = item
        return self._batches[item]

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
