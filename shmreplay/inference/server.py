"""The learner's end of an inference channel: ``InferenceServer``, and the
``InferenceBatch`` its ``receive`` returns.

SEED-style serving over shared memory, no daemon.  A learner process makes
an ``InferenceServer``; its env processes (its children, forked or spawned,
or any process of the same user) attach with ``InferenceClient(srv.address)``
(``env.py``).  Each env holds one slot and has at most one request in
flight; the learner takes every posted request at once (``receive``), runs
its policy on the batch and answers (``respond``).  The bytes are
``layout.py``'s, the memfd and its address ``memfd.py``'s; the message
sequence, who may call what and what each failure does are in
docs/protocol.md, "Inference channel".

The server trusts no byte of the segment: it decides from its own books
(``slots.py``), and writes its header back whenever it changed.  Every
wait is bounded and sleeps on the doorbell, a futex word of the segment
(``futex.py``), after a short spin, waking at least every ``CHECK_S`` to
see whether an env died.

One thread per server: its methods from the thread that serves.  A server
stays with the process that made it.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ..errors import ReplayTimeout
from ..wire import atomics
from ..wire.segment import Segment
from . import futex
from . import layout as wi
from . import memfd as wfd
from .handle import SPIN_US, Handle, deadline_after
from .layout import CHECK_S, H_SLEEPING, SLOT_WORDS, check_values
from .slots import SlotBooks


@dataclass
class InferenceBatch:
    """What ``receive`` took: ``slots`` (int64, one per request), ``data``
    (field -> array of shape (len(slots), *shape), copies), ``lost`` (slots
    whose env died since the last receive; freed, ready for a new env; never
    also in ``slots``)."""

    slots: np.ndarray
    data: dict
    lost: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)


class InferenceServer(Handle):
    """The learner's side.  ``request``/``response``: fields in any form
    ``Client.create_table`` takes; ``slots``: how many envs may attach;
    ``prefix``: the channel's label in /proc/<pid>/maps and fd links
    (default ``shmreplay.inf``; nobody can open it by that).  Its
    ``address`` names this process's descriptor of the channel
    (``/proc/<pid>/fd/<fd>#<token>``)."""

    def __init__(self, request, response, slots: int = 8, prefix: str | None = None,
                 spin_us: float = SPIN_US):
        self._lay = lay = wi.plan(request, response, slots)
        label = wfd.channel_label(prefix)
        self._pid, self._closed, self._sealed = os.getpid(), True, False
        self._fds: list = []  # the channel's descriptor while envs may attach: the address names it
        self._live: list = []  # once serving: its header and control words, to tell the envs at the end
        self._shut = weakref.finalize(self, wi.shut, self._fds, self._pid, self._live)
        try:
            # sealed (no size change, ever) and complete (header, schema) before its address exists
            fd, mm = wfd.create_channel(label, lay.size)
            self._fds.append(fd)
            token = wfd.new_token()
            wi.write_header(mm, lay, self._pid, wi.process_state(self._pid)[1], token)
            self._seg = Segment("memfd:" + label, mm, lay.size)
        except BaseException:
            self._shut()
            raise
        self.address = wfd.address(self._pid, fd, token)
        self._header = wi.Header(self._seg.buf, lay)
        self._hdr, self._ctrl, self._reqv, self._respv = wi.views(self._seg.buf, lay)
        self._bell = futex.word_address(self._hdr, H_SLEEPING)
        self._replies = [futex.word_address(self._ctrl, k * SLOT_WORDS) for k in range(lay.slots)]
        self._waiter = futex.Waiter()
        self._books = SlotBooks(self._ctrl, lay.slots, self._header.mend)
        self._held: list[int] = []  # requests taken and not yet returned by a receive
        self._sleeps = 0  # waits on the doorbell (stats: a server that never sleeps spins)
        self._spin_passes = int(spin_us * 1e-6 * atomics.loads_per_second() / lay.slots)
        self._live += [self._hdr, self._ctrl]
        self._closed = False

    def _sleep(self, until) -> list[int]:
        """Sleep on the doorbell until ``until`` (at most CHECK_S): say so in
        the header, then look once more (an env that posted before it
        read the word did not ring).  What that look took."""
        t = CHECK_S if until is None else min(CHECK_S, until - time.monotonic())
        if t <= 0:
            return []
        atomics.store(self._hdr, H_SLEEPING, 1)
        try:
            lost = len(self._books.lost)
            took = self._books.take(1)
            # a loss found by this look ends the sleep (receive reports it); one found before
            # does not: wait_attached leaves lost for receive, and would spin on it
            if not took and len(self._books.lost) == lost:
                # woken by an env's ring (it swapped the word to 0), a signal, or the timeout
                self._sleeps += 1
                self._waiter.wait(self._bell, 1, t)
        finally:
            atomics.store(self._hdr, H_SLEEPING, 0)
        return took

    # ---- the API ----
    def receive(self, min_batch: int = 1, max_wait_s: float = 0.002, timeout: float | None = None):
        """Wait until a request is posted, then up to ``max_wait_s`` more for
        ``min_batch`` requests; take every request posted by then.  Returns
        at once when an env is found dead (``lost``).  ReplayTimeout if
        nothing came within ``timeout``."""
        self._usable()
        if isinstance(min_batch, bool) or not isinstance(min_batch, (int, np.integer)) or min_batch < 1:
            raise ValueError(f"min_batch must be an int >= 1, got {min_batch!r}")
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0 seconds, got {max_wait_s!r}")
        deadline = deadline_after(timeout)
        taken, self._held, first, spun = self._held, [], None, False
        while True:
            taken += self._books.take(self._spin_passes if spun else 1)
            now = time.monotonic()
            if self._books.lost:  # told at once, with whatever was taken
                break
            if taken:
                first = first or now
                if len(taken) >= min_batch or now - first >= max_wait_s:
                    break
                until = first + max_wait_s
            elif deadline is not None and now >= deadline:
                raise ReplayTimeout(f"no env posted a request within {timeout} s "
                                    f"({self.attached} of {self._lay.slots} slots attached)")
            else:
                until = deadline
            if spun:
                taken += self._sleep(until)
            spun = not spun
        lost = self._books.take_lost()
        if lost.size and taken:  # a request of an env found dead since: nobody to answer
            taken, self._held = self._books.forget(taken, lost)
        slots = np.array(taken, np.int64)
        data = {name: v[slots] for name, v in self._reqv.items()}
        return InferenceBatch(slots, data, lost)

    def respond(self, slots, **fields) -> None:
        """Answer the requests of ``slots`` (some or all of a batch's) with
        ``fields``, each of shape (len(slots), *shape); wakes their envs.
        Slots whose env died or left since are skipped."""
        self._usable()
        s = self._books.check_answerable(slots)
        arrays = check_values(self._lay.response, fields, len(s), "response")
        live = self._books.pending[s] == 1  # 2: its env left since; nothing to write
        for name, a in arrays:
            self._respv[name][s[live]] = a[live]
        for k in self._books.answer(s, live).tolist():  # those whose env sleeps on its word
            futex.wake(self._replies[k])

    def wait_attached(self, n: int, timeout: float | None = None) -> int:
        """Wait until at least ``n`` envs are attached; their number.
        Requests posted meanwhile are kept for the next receive, and so
        are envs found dead (its ``lost``): the wait goes on sleeping."""
        self._usable()
        if not 0 <= n <= self._lay.slots:
            raise ValueError(f"n={n!r}: at most slots={self._lay.slots} envs can attach")
        deadline = deadline_after(timeout)
        while True:
            self._held += self._books.take(1)
            if self.attached >= n:
                return self.attached
            if deadline is not None and time.monotonic() >= deadline:
                raise ReplayTimeout(f"{self.attached} of {n} envs attached within {timeout} s")
            self._held += self._sleep(deadline)

    @property
    def attached(self) -> int:
        """How many envs hold a slot, as of the last look."""
        return self._books.attached

    def stats(self) -> dict:
        return {"slots": self._lay.slots, "attached": self.attached, **self._books.counts,
                "sleeps": self._sleeps, "sealed": self._sealed, "closed": self._closed}

    def seal(self) -> None:
        """Close this process's descriptor of the channel now: attached envs
        go on working (their mappings keep it), no new env can attach (the
        address names nothing, or another object, which an env refuses).
        Nothing is left behind either way: the channel has no name."""
        self._usable()
        wi.close_fds(self._fds, self._pid)
        self._sealed = True

    def close(self) -> None:
        """Tell every env the channel is closed (their calls raise
        InferenceClosed) and close its descriptor; the memory goes with the
        last mapping.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._shut()
            self._seg.close()
        self._hdr = self._ctrl = self._reqv = self._respv = self._header = self._replies = None

    def __reduce__(self):
        raise TypeError("an InferenceServer cannot be pickled: pass its .address to the env "
                        "processes, which attach with shmreplay.InferenceClient(address)")
