"""An env's end of an inference channel: ``InferenceClient``.

An env process (a child of the learner, forked or spawned, or any process
of the learner's user) attaches to an ``InferenceServer``'s address
(``server.py``): it opens the channel's memfd through the learner's
descriptor, checked before anything is mapped (``memfd.py``), and claims a
free slot with a compare-and-swap on its state word (``layout.py``).
``call`` posts one request and waits for its reply: a short spin, then
sleeps on the slot's state word, its reply bell (``futex.py``), looking at
the server at least every ``CHECK_S``.  docs/protocol.md, "Inference
channel", has the message sequence and what each failure does.

One thread at a time per env (``call`` refuses a second); an env stays
with the process that attached it: a forked child attaches its own.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np

from ..errors import CapacityError, InferenceClosed, ReplayError, ReplayTimeout
from ..wire import atomics
from . import futex
from . import layout as wi
from . import memfd as wfd
from .handle import SPIN_US, Handle, deadline_after
from .layout import (ATTACHING, CHECK_S, DONE, H_SLEEPING, H_STATE, IDLE, OPEN, POSTED, SLOT_WORDS,
                     TAKEN, W_SLEEPS, check_values, word)


class InferenceClient(Handle):
    """An env's side: attaches to ``address`` (an ``InferenceServer``'s),
    taking a free slot (CapacityError when all are taken).  ``timeout``
    bounds each call (None: no limit)."""

    def __init__(self, address: str, timeout: float | None = 30.0, spin_us: float = SPIN_US):
        wfd.check_address(address)
        deadline_after(timeout)
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
            deadline = deadline_after(self.timeout)
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
