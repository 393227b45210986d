"""A client's command pipe: its channel to the daemon's engine.

Requests go out as records (encoded by ``wire.records``) with increasing
sequence numbers; replies come back in the order the engine ran the
requests, which is not always the order they were sent (a parked RESERVE or
SAMPLE answers later).  ``wait`` therefore stashes replies to other
requests the caller said it will collect (``expect``), and turns error
replies to streamed commands (COMMIT, UPDATE, which have no reply
otherwise) into a *deferred* error that the next call raises.

Waiting spins briefly on the reply ring, then sleeps on the channel's
doorbell, an eventfd the daemon passed with the channel (docs/protocol.md,
"Waking"), waking every 50 ms to ask the control link whether the daemon
is still there.  One thread at a time.
"""

from __future__ import annotations

import os
import select
import time

import numpy as np

from ..errors import RateLimited, ReplayError, ReplayTimeout
from ..wire import atomics, commitrun
from ..wire import replytake
from ..wire.commitrun import answers_only
from ..wire.channel import ASLEEP_WAITING, CTL_EAGER, CTL_RESP_HEAD, LAZY_MAX, Channel
from ..wire.doorbell import drain
from ..wire.doorbell import ring as ring_bell
from ..wire.records import COMMIT, SAMPLE, put_commit, read_error
from .addone import REPLIES, RING_FULL, add_one
from .link import ControlLink

# Spin budget before sleeping on the doorbell, set from how long the last
# reply took: twice that if it fits under SPIN_MAX_S, else the minimum.  On
# an idle box replies come in tens to a few hundred microseconds (a learner's
# UPDATE then SAMPLE: ~160 us) and spinning saves a ~35 us wake-up on each
# side; on a saturated one the daemon waits for a CPU and spinning would only
# take that CPU from it.  Budgets are counted in atomic loads, calibrated
# once per process (2.5e9/s on this VM; a fixed guess of 1e9/s made the cap
# 80 us instead of 200, so every learner round trip slept).
SPIN_MIN_S, SPIN_MAX_S = 1e-6, 400e-6


class CommandPipe:
    def __init__(self, link: ControlLink, fds: list[int]):
        """Attach the channel and doorbells the daemon passed with its hello
        reply (takes the descriptors)."""
        self.link = link
        self.timeout = link.timeout
        chan_fd, self.to_daemon, self.to_client = fds
        try:
            self.chan = Channel.attach(chan_fd)
        except BaseException:
            os.close(self.to_daemon)
            os.close(self.to_client)
            raise
        self._bell = select.poll()
        self._bell.register(self.to_client, select.POLLIN)
        self.req = self.chan.requests
        self.resp = self.chan.responses
        self.seq = 0
        self.expected: set[int] = set()   # replies to keep if they arrive while waiting for another
        self.stash: dict[int, tuple] = {}
        self.deferred: ReplayError | None = None
        self.loads_per_s = atomics.loads_per_second()
        commitrun.warm()  # commit_one's kernel, loaded now rather than at the first insert
        replytake.warm()  # and take_sample's, rather than at the first sample
        self._resp_pay64 = self.resp.payload.view(np.uint64)  # take_sample reads the payload so
        self.spin = int(16 * SPIN_MIN_S * self.loads_per_s)
        self.lazy_commits = True  # the session's choice (Client.lazy_commits): set_lazy
        self.owed_bell = False  # a lazy record left the daemon asleep: ring before waiting on it
        self.unannounced = 0  # lazy records published to a sleeping daemon since the last bell

    def send(self, put, *args, wake: bool = True) -> int:
        """Send one request: ``put(ring, seq, *args)`` is a ``wire.records``
        encoder.  Returns its sequence number.  ``wake=False`` (a COMMIT,
        which nobody waits for, or a RESERVE asked ahead, whose reply is
        collected later) with ``lazy_commits`` set leaves a sleeping daemon
        asleep: it reads the record at its next wake (the next request that
        wakes it, another client's, or its idle timeout), and the next
        ``wait`` rings first, so waiting on a reply never waits on a daemon
        nobody woke.  At most ``LAZY_MAX`` in a row: the next record rings,
        and so does any while the daemon sleeps with requests parked."""
        ring = self.req
        seq = self.seq + 1
        deadline = None
        while not put(ring, seq, *args):
            # the daemon is behind; it frees room without waking us, so poll
            if deadline is None:
                deadline = time.monotonic() + self.timeout
                if self.lazy_commits or self.owed_bell:  # it may sleep on records nobody announced
                    ring_bell(self.to_daemon)
            self.link.live()
            if time.monotonic() > deadline:
                raise ReplayTimeout(f"command ring stayed full for {self.timeout} s")
            time.sleep(20e-6)
        self.seq = seq
        self._published(ring.publish(), wake)
        return seq

    def set_lazy(self, on: bool) -> None:
        """``Client.lazy_commits``: off, every COMMIT wakes a sleeping
        daemon, and the channel's eager word tells a daemon that is up to
        serve them at once too (``Ring.wants_service``)."""
        self.lazy_commits = bool(on)
        atomics.store(self.req.ctl, CTL_EAGER, 0 if on else 1)

    def commit_one(self, table: int, rid: int, offset: int) -> None:
        """``send(records.put_commit, table, rid, 1, offset, None,
        wake=False)``: a COMMIT of one item with no priority (a step-by-step
        writer's, one per insert), written and published by one kernel
        (``Ring.commit_one``) while the ring has room; else ``send``, which
        waits for room."""
        seq = self.seq + 1
        sleeping = self.req.commit_one(table, seq, rid, offset)
        if sleeping < 0:
            self.send(put_commit, table, rid, 1, offset, None, wake=False)
            return
        self.seq = seq
        self._published(sleeping, False)

    def add_row(self, table: int, rid: int, pos: int, slots, views: tuple, values: tuple,
                live, epoch: int) -> int:
        """``addone.add_one``: store ``values`` as the row of ``slots[pos]``
        and write and publish its COMMIT (``commit_one``'s record), in one
        kernel, after reading the replies that came if one is an error
        (``drain``; answers stay for the call that waits for them).  Returns the
        kernel's answer: >= 0 (published: the caller advances its lease,
        then calls ``row_added``), ``RING_FULL`` (the row is stored, the
        COMMIT not: likewise), or below (nothing written; also after a
        deferred error came: the checked path raises it)."""
        resp = self.resp
        seq = self.seq + 1
        ring = self.req.kernel_args()
        got = add_one(views, values, slots, pos, live, epoch, resp.words(), resp.ctl, resp.head_w,
                      resp.tail, *ring, COMMIT, table, seq, rid)
        if got == REPLIES:  # an error came: read it, as the checked path's prologue would (Session.begin)
            self.drain()
            if self.deferred is not None:
                return REPLIES
            got = add_one(views, values, slots, pos, live, epoch, resp.words(), resp.ctl, resp.head_w,
                          resp.tail, *ring, COMMIT, table, seq, rid)
        if got >= 0:  # the head and seq as the kernel left them, before anything can raise
            self.req.kernel_published()
            self.seq = seq
        return got

    def row_added(self, got: int, table: int, rid: int, pos: int) -> None:
        """After ``add_row`` answered ``got`` >= ``RING_FULL``: ring the
        daemon's doorbell if it is owed, or send the COMMIT that found the
        ring full (waiting for room, as ``send`` does)."""
        if got >= 0:
            self._published(got, False)
        else:
            self.send(put_commit, table, rid, 1, pos, None, wake=False)

    def _published(self, sleeping: int, wake: bool) -> None:
        """A record is published and the daemon's sleeping word read back:
        ring its doorbell, or leave it asleep and owe the ring (``send``)."""
        if (not sleeping or wake or not self.lazy_commits or sleeping >= ASLEEP_WAITING
                or self.unannounced >= LAZY_MAX):
            # a daemon that reads this record reads every one before it: no
            # wake-up is owed once it is woken, or was awake to see it
            self.owed_bell = False
            self.unannounced = 0
            if sleeping:
                ring_bell(self.to_daemon)
        else:
            self.owed_bell = True  # rung by the next wait (``wait``)
            self.unannounced += 1

    def expect(self, seq: int) -> None:
        """The reply to ``seq`` will be collected later: stash it if it comes
        while waiting for another."""
        self.expected.add(seq)

    def outstanding(self, seq: int) -> bool:
        """The reply to ``seq`` (one ``expect``ed) has not been collected yet."""
        return seq in self.expected or seq in self.stash

    def wait(self, seq: int, take, timeout: float = 0.0):
        """Wait for the reply to ``seq`` and return ``take(rec, payload)``
        (a ``wire.records`` decoder, run before the payload is handed back to
        the daemon); raise the error it carries instead.  ``seq == 0`` only
        drains.  ``timeout``: how long the daemon may hold the request; the
        wait is that plus the client's own timeout."""
        if seq in self.stash:
            self.expected.discard(seq)
            return _finish(*self.stash.pop(seq), take)
        ring = self.resp
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout + timeout
        while True:
            while ring.pending():
                rec = ring.peek(0)
                pay = ring.payload_of(rec)
                rseq = int(rec["seq"])
                try:
                    if rseq == seq:
                        self.expected.discard(seq)
                        self._learn_wait(time.perf_counter() - started)
                        return _finish(rec, pay, take)
                    if rseq in self.expected:
                        self.expected.discard(rseq)
                        self.stash[rseq] = (rec.copy(), pay.copy())
                    elif self.deferred is None:
                        self.deferred = read_error(rec, pay)
                finally:
                    ring.consume(1, ring.payload_end(rec))
            if seq == 0:
                return None
            if self.owed_bell:  # not there yet: it may need a record the daemon was not woken for
                ring_bell(self.to_daemon)
                self.owed_bell = False
                self.unannounced = 0
            self._sleep(ring, deadline)

    def take_sample(self, seq: int, n: int, keys, probs, weights) -> int | None:
        """``wait(seq, records.read_sample_reply ...)`` for a reply of
        ``n`` items into the first ``n`` of ``keys``, ``probs`` and
        ``weights``, in one kernel (``replytake``) when the reply is the
        next record and plain: its hold id; None, with nothing read, when
        it is not (not yet come, stashed, behind another, an error): the
        caller then waits for it as before."""
        resp = self.resp
        if seq in self.stash:
            return None
        hid = replytake.take_sample(resp.words(), resp.ctl, resp.head_w, resp.tail_w, resp.pay_tail_w,
                                    resp.tail, self._resp_pay64, SAMPLE, seq, n, keys, probs, weights)
        if hid < 0:
            return None
        resp.kernel_consumed()
        self.expected.discard(seq)
        return hid

    def drain(self) -> None:
        """Read whatever replies arrived (deferred errors among them)."""
        if self.resp.pending():
            self.wait(0, None)

    def errors_waiting(self) -> bool:
        """Does a reply that carries an error wait on the response ring (a
        refused COMMIT's, which only ``drain`` reads)?  Answers (status 0)
        stay for the call that waits for them: read aside first (``drain``
        copies them into the stash), a drawn-ahead batch's reply cost the
        call that collected it ~60-90 us more in a CleanRL loop."""
        resp = self.resp
        return not answers_only(resp.words(), resp.ctl, resp.head_w, resp.tail)

    def raise_deferred(self) -> None:
        if self.deferred is not None:
            err, self.deferred = self.deferred, None
            raise err

    def _learn_wait(self, waited: float) -> None:
        spin = 2 * waited if waited < SPIN_MAX_S else SPIN_MIN_S
        self.spin = int(max(SPIN_MIN_S, min(SPIN_MAX_S, spin)) * self.loads_per_s)

    def _sleep(self, ring, deadline: float) -> None:
        if atomics.spin_until_changed(ring.ctl, CTL_RESP_HEAD, ring.tail, self.spin) != ring.tail:
            return
        if ring.set_sleeping():
            ring.clear_sleeping()
            return
        remaining = deadline - time.monotonic()
        try:
            # wake at least every 50 ms to notice a daemon that died
            if self._bell.poll(max(0, min(50, int(remaining * 1e3) + 1))):
                drain(self.to_client)
                return
        finally:
            ring.clear_sleeping()
        self.link.live()
        if time.monotonic() > deadline:
            raise ReplayTimeout(f"daemon did not answer within {self.timeout} s")

    def close(self) -> None:
        for fd in (self.to_daemon, self.to_client):
            os.close(fd)
        self.req = self.resp = None
        self.chan.release()


def _finish(rec, pay: np.ndarray, take):
    err = read_error(rec, pay)
    if err is not None:
        raise err
    return take(rec, pay)


# Waits for a table's limits happen in the daemon, asked for in slices of at
# most WAIT_SLICE_S, each answered by the daemon, so a daemon that dies
# raises DaemonUnavailable within ~50 ms and one that hangs raises
# ReplayTimeout within a slice plus the client's timeout.
WAIT_SLICE_S = 1.0


def deadline_of(timeout: float | None) -> float | None:
    """A caller's ``timeout`` (None: no limit) as a monotonic deadline."""
    if timeout is not None and not timeout >= 0:
        raise ReplayError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return None if timeout is None else time.monotonic() + timeout


def in_slices(deadline: float | None, attempt):
    """Run ``attempt(wait_s)`` (a request the daemon may hold up to wait_s)
    until it succeeds or ``deadline`` (None: none) passes, asking for at
    most WAIT_SLICE_S at a time."""
    while True:
        left = WAIT_SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return attempt(min(WAIT_SLICE_S, left))
        except RateLimited:
            if deadline is not None and time.monotonic() >= deadline:
                raise
