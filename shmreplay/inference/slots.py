"""An InferenceServer's books of its slots, and its reading of their state words.

Every state word of an inference channel (``layout.py``) may have
been written by any process of the user, so the server decides from these
books alone: which env (pid and start time) holds each slot, and whether
a request of it was taken and not yet answered (``pending``).  A word is
only ever a claim to check against them.  For each slot the books keep
its two *quiet* words (what it reads while nothing needs the server: idle
or done, or taken while its answer is out).  One kernel pass (``scan``)
looks at every word, takes the requests its holder posted and lists the
other slots that changed; only those are settled, in Python:

* a word that is no state word (``parse``: a pid no process can have, a
  code of no state) on a held slot: the holder is treated as dead (its
  slot lost, freed for a new env); on a free slot: garbage, freed;
  either way counted, never raised;
* a word of another pid than the holder's: the holder let go (a graceful
  close, not a loss); the word is then read as a new claim;
* a new claim counts once its env's start time is written and that
  process is alive with it (pid reuse) and it reads idle or posted; a
  claim mid-attach (attaching, by a live process) is waited for, up to
  ``ATTACH_GRACE_S``;
* anything else on a free slot is garbage: counted and the slot freed;
* a word that stays unaccounted for becomes the slot's quiet word, so no
  garbage makes the server spin.

At least every ``CHECK_S`` while the server serves or waits,
``check_alive`` frees the slots of envs that died, exited or became
zombies and reports them as lost once, and ``mend`` (the server's
``Header``) writes back its header where anyone changed it.  Every word
goes to a kernel as a uint64, so no value a process can write overflows
a call.  Used by ``server.py`` only, on the server's thread.
"""

from __future__ import annotations

import time

import numba
import numpy as np

from ..errors import FieldError, ReplayError
from ..numbaconf import JIT
from ..wire import atomics
from . import layout as wi
from .layout import ATTACHING, DONE, IDLE, POSTED, SLOT_WORDS, TAKEN, W_SLEEPS

ATTACH_GRACE_S = 1.0  # an attach takes microseconds: a slot left mid-attach longer is freed
_U8, _IDLE, _DONE, _POSTED, _TAKEN, _ONE, _ZERO = (np.uint64(x) for x in (8, IDLE, DONE, POSTED, TAKEN, 1, 0))
_U64 = np.uint64


@numba.njit(**JIT)
def requiet(owner, pending, qa, qb, k):
    """Slot k's quiet words, from the books."""
    p = owner[k] << _U8
    if p == 0:
        qa[k] = qb[k] = 0
    elif pending[k] == 1:
        qa[k] = qb[k] = p | _TAKEN
    else:
        qa[k], qb[k] = p | _IDLE, p | _DONE


@numba.njit(**JIT)
def scan(ctrl, owner, pending, qa, qb, taken, odd, words, passes):
    """Look at every slot's word, up to ``passes`` times while none is
    out of the quiet: take (posted -> taken) each request its holder
    posted (into ``taken``), list the other slots whose word is not quiet
    (``odd``, their words in ``words``).  Returns the two counts."""
    for _ in range(max(passes, 1)):
        nt = no = 0
        for k in range(len(owner)):
            w = atomics.load(ctrl, k * SLOT_WORDS)
            if w == qa[k] or w == qb[k]:
                continue
            p = owner[k] << _U8
            if p != 0 and pending[k] == 0 and w == p | _POSTED:
                if atomics.cas(ctrl, k * SLOT_WORDS, w, p | _TAKEN) == w:
                    pending[k] = 1
                    requiet(owner, pending, qa, qb, k)
                    taken[nt] = k
                    nt += 1
                continue  # else its env withdrew it: the next pass sees the new word
            odd[no], words[no] = k, w
            no += 1
        if nt or no:
            return nt, no
        atomics.pause()
    return 0, 0


@numba.njit(**JIT)
def answer(ctrl, owner, pending, qa, qb, slots, live, woken):
    """Publish the answers of ``slots[live]`` (taken -> done; written
    already) and close the books of all ``slots``; the slots whose env
    said it sleeps (its sleeping word swapped back to 0 after the state
    word) go into ``woken``; returns (answered, woken)."""
    n = m = 0
    for j in range(len(slots)):
        k = slots[j]
        p = owner[k] << _U8
        if live[j] and atomics.cas(ctrl, k * SLOT_WORDS, p | _TAKEN, p | _DONE) == p | _TAKEN:
            n += 1
            if atomics.cas(ctrl, k * SLOT_WORDS + W_SLEEPS, _ONE, _ZERO) == _ONE:
                woken[m] = k
                m += 1
        pending[k] = 0
        requiet(owner, pending, qa, qb, k)
    return n, m


@numba.njit(**JIT)
def first_bad(slots, pending, seen):
    """The index in ``slots`` of the first that is out of range, repeated,
    or has no request out (-1: none); ``seen`` is scratch, left zeroed."""
    bad = -1
    for j in range(len(slots)):
        k = slots[j]
        if k < 0 or k >= len(pending) or seen[k] or pending[k] == 0:
            bad = j
            break
        seen[k] = 1
    for j in range(len(slots) if bad < 0 else bad):
        seen[slots[j]] = 0
    return bad


class SlotBooks:
    def __init__(self, ctrl: np.ndarray, slots: int, mend):
        self.ctrl, self.slots, self.mend = ctrl, slots, mend
        self.owner = np.zeros(slots, np.uint64)    # the env pid holding each slot (0: none)
        self.start = np.zeros(slots, np.uint64)    # and its start time
        self.pending = np.zeros(slots, np.int8)    # 1: taken, not answered; 2: so, but its env left
        self.qa, self.qb = np.zeros(slots, np.uint64), np.zeros(slots, np.uint64)
        self.taken, self.odd = np.zeros(slots, np.int64), np.zeros(slots, np.int64)
        self.words = np.zeros(slots, np.uint64)
        self.seen = np.zeros(slots, np.int8)
        self.lost: list[int] = []
        self.attaching: dict[int, tuple[int, float]] = {}  # slot -> (its word, since when)
        self.counts = {"served": 0, "lost": 0, "garbage": 0, "header_mended": 0}
        self.checked = time.monotonic()

    @property
    def attached(self) -> int:
        return int(np.count_nonzero(self.owner))

    def requiet(self, k: int) -> None:
        requiet(self.owner, self.pending, self.qa, self.qb, k)

    def release(self, k: int, lost: bool) -> None:
        self.owner[k] = self.start[k] = 0
        if self.pending[k] == 1:
            self.pending[k] = 2
        self.requiet(k)
        if lost:
            self.lost.append(k)
            self.counts["lost"] += 1

    def free(self, k: int, w: int) -> None:
        """Free slot k if its word still reads ``w`` (a claim no live process backs)."""
        atomics.cas(self.ctrl, k * SLOT_WORDS, _U64(w), _ZERO)

    def settle(self, k: int, w: int) -> bool:
        """Account for slot k's word ``w``, which is neither of its quiet
        words nor its holder's request; True if it is a new holder's request."""
        claim = wi.parse(w)
        if claim is None and w:  # no state word: its holder (if any) is as good as dead
            self.counts["garbage"] += 1
            if self.owner[k]:
                self.release(k, lost=True)
            self.attaching.pop(k, None)
            self.free(k, w)
            return False
        if self.owner[k] and (claim is None or claim[0] != self.owner[k] or claim[1] == ATTACHING):
            self.release(k, lost=False)  # its env let go of it
        if claim is None:
            return False
        pid, code = claim
        if not self.owner[k]:
            if code == ATTACHING and wi.alive(pid):  # its start word comes next
                if self.attaching.get(k, (0,))[0] != w:
                    self.attaching[k] = (w, time.monotonic())
                self.qb[k] = w
                return False
            self.attaching.pop(k, None)
            start = int(atomics.load(self.ctrl, k * SLOT_WORDS + wi.W_START))
            if code not in (IDLE, POSTED) or start == 0 or not wi.alive(pid, start):
                self.counts["garbage"] += 1
                self.free(k, w)
                return False
            self.owner[k], self.start[k] = pid, start
            self.requiet(k)
        if code == POSTED and self.pending[k] == 0:
            return True
        self.qb[k] = w  # waits for its next change (or, posted, for respond())
        return False

    def take(self, passes: int) -> list[int]:
        """Look at every slot (spinning up to ``passes`` times while none
        changes), take the requests posted, settle the other changes; and
        every CHECK_S, ``check_alive``.  The slots taken."""
        nt, no = scan(self.ctrl, self.owner, self.pending, self.qa, self.qb, self.taken, self.odd,
                      self.words, passes)
        took = self.taken[:nt].tolist()
        for k, w in zip(self.odd[:no].tolist(), self.words[:no].tolist()):
            if self.settle(k, w) and atomics.cas(self.ctrl, k * SLOT_WORDS, _U64(w),
                                                 _U64(wi.word(w >> 8, TAKEN))) == w:
                self.pending[k] = 1
                self.requiet(k)
                took.append(k)
        if time.monotonic() - self.checked >= wi.CHECK_S:
            self.check_alive()
            if self.mend():
                self.counts["header_mended"] += 1
        return took

    def check_alive(self) -> None:
        """Free the slots of envs that died (reported as lost), and claims
        no live process backs (an env that died attaching, a stray word) or
        that stayed mid-attach past ATTACH_GRACE_S."""
        now = time.monotonic()
        for k in range(self.slots):
            w = int(atomics.load(self.ctrl, k * SLOT_WORDS))
            owner = int(self.owner[k])
            if owner and w >> 8 == owner and not wi.alive(owner, int(self.start[k])):
                self.free(k, w)
                self.release(k, lost=True)
            elif not owner and w:
                since = self.attaching.get(k)
                if not wi.alive(w >> 8) or (since and since[0] == w and now - since[1] > ATTACH_GRACE_S):
                    self.attaching.pop(k, None)
                    self.free(k, w)
        self.checked = now

    def check_answerable(self, slots) -> np.ndarray:
        """``slots`` as int64 once each is a distinct slot with a request
        taken and not yet answered; else an error saying which is not."""
        s = np.asarray(slots)
        if s.ndim != 1 or (s.size and s.dtype.kind not in "iu"):
            raise FieldError(f"slots must be a 1-D array of ints (a batch's .slots), got {s.dtype} "
                             f"of shape {s.shape}")
        s = s.astype(np.int64, copy=False)
        j = first_bad(s, self.pending, self.seen)
        if j >= 0:
            k = int(s[j])
            if not 0 <= k < self.slots or k in s[:j]:
                raise FieldError(f"slots {s.tolist()}: slot {k} is not a distinct slot number in "
                                 f"[0, {self.slots})")
            raise ReplayError(f"slot {k} has no request waiting for a response: respond once to "
                              "each slot a receive() returned")
        return s

    def answer(self, slots: np.ndarray, live: np.ndarray) -> np.ndarray:
        """Publish the answers of ``slots[live]`` (written already) and
        close the books of all ``slots``; the slots whose env sleeps, to be woken."""
        woken = np.empty(len(slots), np.int64)
        n, m = answer(self.ctrl, self.owner, self.pending, self.qa, self.qb, slots, live, woken)
        self.counts["served"] += n
        return woken[:m]

    def forget(self, taken: list[int], lost: np.ndarray) -> tuple[list[int], list[int]]:
        """Split ``taken`` against ``lost`` (slots whose env was found dead):
        (the requests to return now, those held back for the next receive).
        A request taken from the env that died reads 2 in ``pending`` (its
        env left since): nobody to answer, dropped.  One that reads 1 is a
        new env's, which attached to the freed slot and posted before the
        loss was told (``wait_attached`` keeps requests across it; a slot
        at 2 takes none): held back, so that no batch has a slot in both
        ``slots`` and ``lost``, and the learner hears of the loss first."""
        gone, now, held = set(lost.tolist()), [], []
        for k in taken:
            if k not in gone:
                now.append(k)
            elif self.pending[k] == 1:
                held.append(k)
            else:
                self.pending[k] = 0
                self.requiet(k)
        return now, held

    def take_lost(self) -> np.ndarray:
        """The slots lost since the last call, each once (a slot can be lost
        twice in one wait: its env, then a new env of it)."""
        lost, self.lost = np.array(list(dict.fromkeys(self.lost)), np.int64), []
        return lost
