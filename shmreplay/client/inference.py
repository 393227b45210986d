"""The inference channel: SEED-style serving over shared memory, no daemon.

A learner process makes an ``InferenceServer``; its env processes (its
children, forked or spawned, or any process of the same user) attach with
``InferenceClient(srv.address)``.  Each env holds one slot and has at most
one request in flight (``call`` posts it and waits for the reply); the
learner takes every posted request at once (``receive``), runs its policy
on the batch and answers (``respond``).  The bytes are ``wire/inference.py``'s;
the message sequence, who may call what and what each failure does are in
docs/protocol.md, "Inference channel".

The server trusts no byte of the segment: it decides from its own books
(``slotbooks.py``), and writes its header back whenever it changed.  Every
wait is bounded and sleeps on a futex word of the segment
(``wire/futex.py``) after a short spin, waking at least every ``CHECK_S``
to see whether the other side still lives.

One thread per object: a server's methods from the thread that serves,
an env's ``call`` from one thread at a time.  Objects stay with the
process that made them: a forked child attaches its own.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError, InferenceClosed, ReplayError, ReplayTimeout
from ..wire import atomics, futex
from ..wire import inference as wi
from ..wire import inference_fd as wfd
from ..wire.inference import (ATTACHING, CHECK_S, DONE, H_SLEEPING, H_STATE, IDLE, OPEN, POSTED, SLOT_WORDS,
                              TAKEN, W_SLEEPS, check_values, word)
from ..wire.segment import Segment
from .slotbooks import SlotBooks

SPIN_US = 50     # spin this long on the shared words before sleeping on a futex word


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


def _deadline(timeout):
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds or None (no limit), got {timeout!r}")
    return None if timeout is None else time.monotonic() + timeout


class _Handle:
    """What both ends share: ``with``, and refusing use after close or in
    another process (a forked child makes its own)."""

    def _usable(self) -> None:
        if self._closed:
            raise InferenceClosed(f"this {type(self).__name__} of {self.address} is closed")
        if os.getpid() != self._pid:
            raise ReplayError(f"this {type(self).__name__} belongs to process {self._pid}, not "
                              f"{os.getpid()}: a forked child attaches its own, "
                              "InferenceClient(address)")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InferenceServer(_Handle):
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
        deadline = _deadline(timeout)
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
        deadline = _deadline(timeout)
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


class InferenceClient(_Handle):
    """An env's side: attaches to ``address`` (an ``InferenceServer``'s),
    taking a free slot (CapacityError when all are taken).  ``timeout``
    bounds each call (None: no limit)."""

    def __init__(self, address: str, timeout: float | None = 30.0, spin_us: float = SPIN_US):
        wfd.check_address(address)
        _deadline(timeout)
        self.address, self.timeout, self._pid, self._closed = address, timeout, os.getpid(), True
        self._lock, self._stale = threading.Lock(), False
        buf = wfd.open_channel(address)
        req = resp = None
        try:
            lay, self._server, self._server_start = wi.read_layout(buf, address)
            self._words, _, req, resp = wi.views(buf, lay)  # the header and the control lines
            self._lay, self.slots = lay, lay.slots
            self._check_server()
            me = self._pid
            for k in range(lay.slots):
                if atomics.cas(self._words, lay.ctrl // 8 + k * SLOT_WORDS, 0, word(me, ATTACHING)) == 0:
                    break
            else:
                raise CapacityError(f"inference channel {address} is full: all slots={lay.slots} are held "
                                    "by attached envs; make the InferenceServer with more slots, or "
                                    "close an env (InferenceClient.close()) first")
            self.slot, self._at = k, lay.ctrl // 8 + k * SLOT_WORDS
            self._reply = futex.word_address(self._words, self._at)  # its state word is its reply bell
            self._bell = futex.word_address(self._words, H_SLEEPING)
            self._waiter = futex.Waiter()
            self._req = {name: v[k, ...] for name, v in req.items()}
            self._resp = {name: v[k, ...] for name, v in resp.items()}
            atomics.store(self._words, self._at + wi.W_START, wi.process_state(me)[1])
            if atomics.cas(self._words, self._at, word(me, ATTACHING), word(me, IDLE)) != word(me, ATTACHING):
                raise InferenceClosed(f"slot {k} of {address} was taken back while this env attached "
                                      "(it stalled past the server's grace?): attach again")
            wi.ring(self._words, self._bell)
        except BaseException as exc:
            # unmapped now, not when the traceback goes: an env that retries a full channel
            # keeping its errors would hold a mapping per try.  Every view of it first (here
            # and in the frames the traceback keeps): numpy does not pin an mmap's buffer, so
            # a view left would point at unmapped memory
            self._words = self._req = self._resp = req = resp = _ = None
            traceback.clear_frames(exc.__traceback__)
            buf.close()
            raise
        self._spin = max(1, int(spin_us * 1e-6 * atomics.loads_per_second()))
        self._closed = False

    def _check_server(self) -> None:
        if atomics.load(self._words, H_STATE) != OPEN:
            raise InferenceClosed(f"the InferenceServer closed inference channel {self.address}")
        if not wi.alive(self._server, self._server_start):
            raise InferenceClosed(f"the InferenceServer of {self.address} (process {self._server}) "
                                  "died: its learner is gone")

    def call(self, **fields) -> dict:
        """Post one request and wait for its reply: {response field: array}."""
        self._usable()
        if not self._lock.acquire(blocking=False):
            raise ReplayError("another thread is in call() on this InferenceClient: one request in "
                              "flight per env; give each thread its own InferenceClient")
        try:
            deadline = _deadline(self.timeout)
            if self._stale:  # the reply to a call that timed out: drop it
                self._await(deadline)
                atomics.store(self._words, self._at, word(self._pid, IDLE))
                self._stale = False
            for name, a in check_values(self._lay.request, fields, None, "request"):
                np.copyto(self._req[name], a, casting="same_kind")
            # the data first, then the word; then whether the server sleeps
            if atomics.store_then_load(self._words, self._at, word(self._pid, POSTED), H_SLEEPING):
                wi.ring(self._words, self._bell)
            self._await(deadline)
            out = {name: v.copy() for name, v in self._resp.items()}
            atomics.store(self._words, self._at, word(self._pid, IDLE))
            return out
        finally:
            self._lock.release()

    def _await(self, deadline) -> None:
        """Until the slot reads DONE: spin, then sleep on its state word,
        looking at the server at least every CHECK_S."""
        me, done = self._pid, word(self._pid, DONE)
        w = int(atomics.load(self._words, self._at))
        for _ in range(2):  # POSTED -> TAKEN -> DONE
            if w == done:
                return
            if w >> 8 != me:  # not its own word (any 64-bit value): told below, never spun on
                break
            w = int(atomics.spin_until_changed(self._words, self._at, w, self._spin))
        checked = time.monotonic()
        try:
            while w != done:
                if w >> 8 != me or w & 0xFF not in (POSTED, TAKEN):
                    self._check_server()
                    raise InferenceClosed(f"slot {self.slot} of {self.address} was taken from this env "
                                          f"(it reads {w:#x}): attach again")
                now = time.monotonic()
                if atomics.load(self._words, H_STATE) != OPEN or now - checked >= CHECK_S:
                    self._check_server()
                    checked = now
                if deadline is not None and now >= deadline:
                    self._give_up()
                # say it sleeps, then look once more: the server swaps DONE in, then reads that
                w = int(atomics.store_then_load(self._words, self._at + W_SLEEPS, 1, self._at))
                if w != done:
                    self._waiter.wait(self._reply, w, CHECK_S if deadline is None else
                                      min(CHECK_S, deadline - now))
                    w = int(atomics.load(self._words, self._at))
        finally:
            atomics.store(self._words, self._at + W_SLEEPS, 0)

    def _give_up(self):
        posted = word(self._pid, POSTED)
        if atomics.cas(self._words, self._at, posted, word(self._pid, IDLE)) == posted:
            raise ReplayTimeout(f"no reply within {self.timeout} s; the request was withdrawn "
                                "(the server had not taken it)")
        self._stale = True
        raise ReplayTimeout(f"no reply within {self.timeout} s: the server took the request and has "
                            "not answered; the next call first waits for that reply and drops it")

    def close(self) -> None:
        """Free the slot (a request in flight is dropped).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            w = int(atomics.load(self._words, self._at))
            for _ in range(4):  # the server may take a request meanwhile
                if w >> 8 != self._pid:
                    break
                found = int(atomics.cas(self._words, self._at, np.uint64(w), 0))
                if found == w:
                    break
                w = found
            wi.ring(self._words, self._bell)
        self._words = self._req = self._resp = None

    def __reduce__(self):
        raise TypeError("an InferenceClient cannot be pickled: pass the server's address and "
                        "attach in the process that calls, InferenceClient(address)")
