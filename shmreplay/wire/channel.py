"""A client's command channel: two single-producer/single-consumer rings.

Each ring has one producer thread (in one process) and one consumer thread
(in the other): the client's thread and the daemon's engine thread.

One sealed memfd per attached client, created by the daemon and passed to
the client over the control socket (SCM_RIGHTS), so no other process can
open it by name::

    0     header (CHANNEL_HEADER): magic, layout version, sizes, offsets, pids
    256   control words, uint64, each on its own 64-byte cache line (CTL_*)
    1024  request records   RECORD[req_slots]    client -> daemon
          response records  RECORD[resp_slots]   daemon -> client
          request payload   bytes[req_payload]   arrays a request refers to
          response payload  bytes[resp_payload]  arrays a response refers to

Each ring has one producer and one consumer.  ``head`` and ``tail`` are
monotonic uint64 counters (slot = counter % slots); only the producer writes
``head`` and only the consumer writes ``tail``.  Payload bytes live in a
byte ring beside the records: the producer places a payload contiguously
(skipping to the start of the ring when it would wrap) and names it in the
record as (pay_off, pay_len) with ``pay_off`` a monotonic byte counter; the
consumer, after it is done with a record, sets ``pay_tail`` to that record's
``pay_off + pay_len``, which frees every byte before it, skipped gap included.

Publication order.  The producer writes the payload and the record, then
stores ``head``.  On x86-64 (TSO) stores become visible in program order, and
the consumer's loads of ``head`` then the record are not reordered either, so
a consumer that sees the new head sees the whole record; the store is also a
compiler barrier because it is an opaque call (``atomics.store``).  On ARM or
POWER this needs a release store of ``head`` (stlr) and an acquire load on the
consumer side (ldar), or a ``dmb ish`` on each side; the seq_cst atomics used
here give exactly that on those targets, so the code is portable, but only
x86-64 is tested.

Sleeping.  A consumer that found nothing spins briefly, then sets its
``*_SLEEPING`` word, re-checks ``head``, and only then waits on its eventfd
(one per direction, private to the daemon and this client, passed with the
channel); the producer publishes ``head`` and then reads that word, writing
the eventfd if it is set.  Both sides use seq_cst store-then-load
(``atomics.store_then_load``), so at least one of them sees the other and a
wake-up cannot be lost.  The daemon sets its word to ``ASLEEP_WAITING``
while requests are parked, so that a record its producer marks lazy (a
COMMIT, which nobody waits for) still wakes it then.

A misbehaving peer can only write its own channel.  Whatever values it puts
in a record or a control word, ``check_record``/``pending`` bound every
offset and count before use, so the daemon never reads or writes outside the
channel's own arrays.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from ..errors import CapacityError, LayoutError, ProtocolError
from . import atomics, records
from .commitrun import MASK16, W_OP, put_commit_one
from .records import COMMIT, RECORD
from .segment import Segment, prefault

CHANNEL_MAGIC = b"SHMRCHN\x00"
CHANNEL_VERSION = 2  # 2: records_version in the header

CHANNEL_HEADER = np.dtype([
    ("magic", "S8"), ("layout_version", "<u4"), ("header_size", "<u4"),
    ("req_slots", "<u4"), ("resp_slots", "<u4"),
    ("req_payload", "<u8"), ("resp_payload", "<u8"),
    ("req_off", "<u8"), ("resp_off", "<u8"), ("req_pay_off", "<u8"), ("resp_pay_off", "<u8"),
    ("client_pid", "<u8"), ("daemon_pid", "<u8"), ("segment_size", "<u8"),
    ("records_version", "<u4"),
])
CTL_OFF = 256
CTL_WORDS = 96
REC_OFF = 1024
# control-word indices; 8 words apart so each sits on its own cache line
CTL_REQ_HEAD = 0
CTL_REQ_TAIL = 8
CTL_REQ_PAY_TAIL = 16
CTL_RESP_HEAD = 24
CTL_RESP_TAIL = 32
CTL_RESP_PAY_TAIL = 40
CTL_DAEMON_SLEEPING = 48
CTL_CLIENT_SLEEPING = 56
# nonzero: the client's COMMITs want serving at once (its lazy_commits is
# off); only the client writes it, and it decides only when its own
# records are served (``Ring.wants_service``)
CTL_EAGER = 64
# a sleeping word's values: awake; asleep (a lazy record, which nobody waits
# for, may leave the daemon asleep); asleep while a parked request waits on
# the tables (every record wakes it: a lazy COMMIT may be what it waits for)
AWAKE, ASLEEP, ASLEEP_WAITING = 0, 1, 2

# Lazy records (COMMITs) in a row: a client leaves a sleeping daemon at most
# this many before the next one rings, and a daemon that is up leaves at
# most this many waiting (``Ring.wants_service``).  Unbounded on the
# client's side, a writer flat out behind a daemon that fell asleep between
# two of its commits kept it asleep, and it never learned the writer's pace
# again (sac-mujoco insert64: 1.14-1.37M against 1.6M items/s); 16 is more
# than a CleanRL loop inserts between two samples (10)
LAZY_MAX = 16

ALIGN = 64


def _align(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


class ChannelLayout:
    def __init__(self, req_slots: int, resp_slots: int, req_payload: int, resp_payload: int):
        self.req_slots, self.resp_slots = req_slots, resp_slots
        self.req_payload, self.resp_payload = req_payload, resp_payload
        self.req_off = REC_OFF
        self.resp_off = self.req_off + req_slots * RECORD.itemsize
        self.req_pay_off = _align(self.resp_off + resp_slots * RECORD.itemsize, 4096)
        self.resp_pay_off = _align(self.req_pay_off + req_payload, 4096)
        self.size = _align(self.resp_pay_off + resp_payload, 4096)


class Ring:
    """One direction of a channel.  Use it from one thread of the producer
    process and one thread of the consumer process; never both ends from
    the same object."""

    def __init__(self, ctl, records, payload, head_w, tail_w, pay_tail_w, sleeping_w, eager_w=None):
        self.ctl = ctl
        self.records = records
        self.payload = payload
        self.slots = records.shape[0]
        self.pay_size = payload.shape[0]
        self.head_w, self.tail_w, self.pay_tail_w, self.sleeping_w = head_w, tail_w, pay_tail_w, sleeping_w
        # private cursor of whichever end this object serves
        self.head = int(atomics.load(ctl, head_w))
        self.pay_head = 0
        self.tail = int(atomics.load(ctl, tail_w))
        self.lazy_to = self.tail  # consumer: records before it are COMMITs left to wait (wants_service)
        self.eager_w = eager_w  # the requests': the producer's CTL_EAGER word (wants_service)
        self._words = None

    # ---- producer side ----
    def room(self) -> int:
        """Record slots free, or -1 if the consumer's tail is corrupt."""
        used = self.head - int(atomics.load(self.ctl, self.tail_w))
        if used < 0 or used > self.slots:
            return -1
        return self.slots - used

    def place_payload(self, nbytes: int):
        """Claim ``nbytes`` of contiguous payload; returns (pay_off, uint8 view)
        or None when the consumer has not freed enough yet."""
        if nbytes == 0:
            return 0, self.payload[:0]
        need = _align(nbytes)
        if need > self.pay_size:
            raise CapacityError(
                f"payload of {nbytes} bytes exceeds the channel's {self.pay_size}-byte area")
        pos = self.pay_head % self.pay_size
        start = self.pay_head if pos + need <= self.pay_size else self.pay_head + (self.pay_size - pos)
        pay_tail = int(atomics.load(self.ctl, self.pay_tail_w))
        if start + need - pay_tail > self.pay_size:
            return None
        self.pay_head = start + need
        p = start % self.pay_size
        return start, self.payload[p:p + nbytes]

    def put(self, op, table, seq, a0, a1, a2, f0, pay_off, pay_len, status):
        """Write the next record (caller checked room() and placed the
        payload); not visible until publish().  ``records`` encodes them."""
        # one tuple assignment: ~0.4 us, ten field assignments: ~5 us
        self.records[self.head % self.slots] = (op, status, table, seq, a0, a1, a2, f0, pay_off, pay_len)
        self.head += 1

    def publish(self) -> int:
        """Make every put() record visible; returns the consumer's sleeping
        word: 0 (``AWAKE``) or, if it sleeps and must be woken, nonzero:
        ``ASLEEP``, or ``ASLEEP_WAITING`` (the daemon has parked requests,
        which any record may unblock: a lazy one wakes it too).  A value a
        peer scribbled is nonzero or not like any other: at worst an extra
        or a later wake-up."""
        return int(atomics.store_then_load(self.ctl, self.head_w, self.head, self.sleeping_w))

    def kernel_args(self) -> tuple:
        """(words, ctl, head, tail_w, head_w, sleeping_w): what a kernel that
        writes and publishes the next record takes, as ``put_commit_one``
        does (``client.addone``); it calls ``kernel_published`` after."""
        return self.words(), self.ctl, self.head, self.tail_w, self.head_w, self.sleeping_w

    def kernel_published(self) -> None:
        """A kernel given ``kernel_args`` wrote and published one record."""
        self.head += 1

    def kernel_consumed(self) -> None:
        """Consumer side: a kernel read the record at ``tail`` and stored
        the new tail (and payload tail), as ``consume(1, ...)`` does."""
        self.tail += 1

    def commit_one(self, table: int, seq: int, rid: int, offset: int) -> int:
        """``records.put_commit(ring, seq, table, rid, 1, offset, None)`` then
        ``publish()``, in one kernel (``commitrun.put_commit_one``): what
        ``publish`` returns (capped at ``commitrun.SLEEPING_TOP``), or -1
        with nothing written when there is no room (``room() <= 0``)."""
        got = put_commit_one(self.words(), self.ctl, self.head, self.tail_w, self.head_w,
                             self.sleeping_w, COMMIT, table, seq, rid, offset)
        if got >= 0:
            self.head += 1
        return got

    # ---- consumer side ----
    def pending(self) -> int:
        """Records ready to read; raises ProtocolError on a corrupt head."""
        n = int(atomics.load(self.ctl, self.head_w)) - self.tail
        if n < 0 or n > self.slots:
            raise ProtocolError(f"ring head moved to an impossible position ({n} records pending)")
        return n

    def has_pending(self) -> bool:
        """Cheap check for new records that never raises (a corrupt head
        counts as pending, so that pending() reports it where it is handled).
        A plain read (numpy's, ~0.3 us against the atomic load's ~0.9: a
        step-by-step writer asks once an insert): an aligned 8-byte load is
        whole on every CPU this runs on, and what it hints at is read again
        by ``pending()``'s atomic load before any record is."""
        return int(self.ctl[self.head_w]) != self.tail

    def peek(self, i: int = 0):
        return self.records[(self.tail + i) % self.slots]

    def words(self) -> np.ndarray:
        """The records as uint64[slots, 8], for kernels that read many
        (``commitrun.commit_run``); the same memory as ``records``."""
        w = self._words
        if w is None:
            w = self._words = self.records.view(np.uint64).reshape(self.slots, 8)
        return w

    def payload_of(self, rec) -> np.ndarray:
        """The payload bytes a record names, bounds-checked."""
        off, ln = int(rec["pay_off"]), int(rec["pay_len"])
        if ln == 0:
            return self.payload[:0]
        p = off % self.pay_size
        if ln > self.pay_size or p + ln > self.pay_size:
            raise ProtocolError(f"record payload ({off}, {ln}) lies outside the payload area")
        return self.payload[p:p + ln]

    @staticmethod
    def payload_end(rec) -> int | None:
        """What ``pay_tail`` becomes once this record is consumed (None: no payload)."""
        n = int(rec["pay_len"])
        return int(rec["pay_off"]) + n if n else None

    def consume(self, count: int, pay_end: int | None) -> None:
        """Hand ``count`` records (and payload up to pay_end) back to the producer."""
        self.tail += count
        if pay_end is not None:
            atomics.store(self.ctl, self.pay_tail_w, pay_end)
        atomics.store(self.ctl, self.tail_w, self.tail)

    def wants_service(self, limit: int) -> bool:
        """Consumer side, for the daemon's idle loop (server/engine/idle.py,
        "Lazy COMMITs"): are records pending that it should serve now?  Not
        while fewer than ``limit`` are, all COMMITs: they wait for a record
        that wants an answer, or for ``limit`` of them (one, if the
        producer set its eager word: a client whose ``lazy_commits`` is off).  Each op is read
        once (``lazy_to``), after an atomic load of the head.  Never raises:
        a corrupt head counts as wanting service (``pending`` reports it)."""
        tail = self.tail
        head = int(self.ctl[self.head_w])  # a plain read, as has_pending's
        if self.eager_w is not None and int(self.ctl[self.eager_w]):
            limit = 1  # its client wants its COMMITs served at once (lazy_commits off)
        if head == max(tail, self.lazy_to):  # nothing new since the ops were read: COMMITs, if any
            return head - tail >= limit
        head = int(atomics.load(self.ctl, self.head_w))
        n = head - tail
        if n <= 0 or n > self.slots or n >= limit:
            return n != 0
        w = self.words()
        for pos in range(max(tail, self.lazy_to), head):
            if int(w[pos % self.slots, W_OP] & MASK16) != COMMIT:
                return True
        self.lazy_to = head
        return False

    def set_sleeping(self, word: int = 1, lazy: bool = False) -> bool:
        """Announce that the consumer will sleep (``word``: ``ASLEEP``, or
        the daemon's ``ASLEEP_WAITING``); True if work arrived meanwhile
        (``lazy``: beyond the COMMITs ``wants_service`` left waiting)."""
        seen = max(self.tail, self.lazy_to) if lazy else self.tail
        return atomics.store_then_load(self.ctl, self.sleeping_w, word, self.head_w) != seen

    def clear_sleeping(self) -> None:
        atomics.store(self.ctl, self.sleeping_w, 0)


class Channel:
    """The mapped channel segment with its two rings."""

    def __init__(self, seg: Segment, layout: ChannelLayout):
        self.seg = seg
        self.layout = layout
        buf = seg.buf
        self.header = np.ndarray((), CHANNEL_HEADER, buffer=buf, offset=0)
        self.ctl = np.ndarray((CTL_WORDS,), np.uint64, buffer=buf, offset=CTL_OFF)
        lo = layout
        req_recs = np.ndarray((lo.req_slots,), RECORD, buffer=buf, offset=lo.req_off)
        resp_recs = np.ndarray((lo.resp_slots,), RECORD, buffer=buf, offset=lo.resp_off)
        req_pay = np.ndarray((lo.req_payload,), np.uint8, buffer=buf, offset=lo.req_pay_off)
        resp_pay = np.ndarray((lo.resp_payload,), np.uint8, buffer=buf, offset=lo.resp_pay_off)
        self.requests = Ring(self.ctl, req_recs, req_pay, CTL_REQ_HEAD, CTL_REQ_TAIL,
                             CTL_REQ_PAY_TAIL, CTL_DAEMON_SLEEPING, CTL_EAGER)
        self.responses = Ring(self.ctl, resp_recs, resp_pay, CTL_RESP_HEAD, CTL_RESP_TAIL,
                              CTL_RESP_PAY_TAIL, CTL_CLIENT_SLEEPING)

    @classmethod
    def create(cls, layout: ChannelLayout, client_pid: int, daemon_pid: int,
               label: str = "shmreplay-channel") -> "Channel":
        """Daemon: a channel in a sealed memfd.  It has no name another
        process could open; the daemon passes ``fd`` to its one client over
        the control socket and then closes it.  Its size is sealed, so the
        client cannot shrink it under the daemon's mapping (a SIGBUS).
        ``label`` only names it in /proc/<pid>/maps (no one can open it by it)."""
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, layout.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, layout.size)
        except BaseException:
            os.close(fd)
            raise
        seg = Segment("memfd:" + label, mm, layout.size, fd)
        prefault(mm, write=True)
        h = np.ndarray((), CHANNEL_HEADER, buffer=mm, offset=0)
        h["layout_version"], h["header_size"] = CHANNEL_VERSION, REC_OFF
        h["req_slots"], h["resp_slots"] = layout.req_slots, layout.resp_slots
        h["req_payload"], h["resp_payload"] = layout.req_payload, layout.resp_payload
        h["req_off"], h["resp_off"] = layout.req_off, layout.resp_off
        h["req_pay_off"], h["resp_pay_off"] = layout.req_pay_off, layout.resp_pay_off
        h["client_pid"], h["daemon_pid"], h["segment_size"] = client_pid, daemon_pid, layout.size
        h["records_version"] = records.VERSION
        h["magic"] = CHANNEL_MAGIC
        del h
        return cls(seg, layout)

    @property
    def fd(self) -> int | None:
        """The memfd, until the daemon handed it over (``handed_over``)."""
        return self.seg.fd

    def handed_over(self) -> None:
        """Daemon: the client has its copy; ours is not needed (the mapping stays)."""
        if self.seg.fd is not None:
            os.close(self.seg.fd)
            self.seg.fd = None

    @classmethod
    def attach(cls, fd: int) -> "Channel":
        """Client: map the channel the daemon passed; takes ``fd`` (closes it)."""
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = Segment("memfd:channel", mm, size)
        try:
            h = np.ndarray((), CHANNEL_HEADER, buffer=seg.buf, offset=0)
            if bytes(h["magic"]) != CHANNEL_MAGIC:
                raise LayoutError("the daemon passed something that is not a shmreplay channel")
            if int(h["layout_version"]) != CHANNEL_VERSION:
                raise LayoutError(f"channel has layout version {int(h['layout_version'])}, "
                                  f"this build reads {CHANNEL_VERSION}")
            if int(h["records_version"]) != records.VERSION:
                raise LayoutError(f"channel carries records of version "
                                  f"{int(h['records_version'])}, this build speaks {records.VERSION}")
            layout = ChannelLayout(int(h["req_slots"]), int(h["resp_slots"]),
                                   int(h["req_payload"]), int(h["resp_payload"]))
            if layout.size != seg.size or layout.req_off != int(h["req_off"]):
                raise LayoutError("channel header disagrees with its size")
            del h
            return cls(seg, layout)
        except BaseException:
            seg.close()
            raise

    def release(self) -> None:
        self.header = self.ctl = self.requests = self.responses = None
        self.seg.close()

