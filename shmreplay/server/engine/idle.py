"""How the engine waits when no client sent anything: spin, then sleep.

The spin budget follows the gaps between commands: after a wait, it is set
to twice the gap if that fits under ``spin_us`` (commands come back to
back: spinning saves a wake-up, ~35 us to 150 us on this VM), else to the
2 us minimum (a trickle: spinning would be pure cost, e.g. 1,000
inserts/s).  Two rules on top:

* after a pass that did work the engine spins at least ``BURST_S``:
  commands come in pairs (a learner's UPDATE then SAMPLE, an actor's
  COMMIT then RESERVE), and a learner whose last gap was a training step
  long would otherwise see the daemon asleep again for the SAMPLE that
  follows its UPDATE (measured: 1.4 sleeps per sample+update);
* while a learner samples often (its SAMPLEs less than ``learner_spin_us``
  apart), the engine busy-polls until twice that interval has passed since
  the last SAMPLE: the learner's next UPDATE and SAMPLE find it awake.  A
  learner that stops, or samples less often, gets the plain budget, so an
  idle daemon still sleeps (and so does a crowded one: the last rule);
* the learner's rhythm decides how far that reaches (``learner_spin_max_us``):
  a learner that samples less often than ``learner_spin_us`` but more
  often than that keeps the engine up too, as long as the spin costs
  nobody a core.  The engine watches while it spins: once more threads
  are runnable on the machine than it has CPUs (``/proc/loadavg``'s
  running count, ~2 us a read: a learner's gather helper, torch's
  workers, actors waiting for the core it holds, whatever their nice), or
  it has itself lost ``CONTENDED_S`` to other threads, it sleeps, and
  spins for such learners again only after ``BACKOFF_S``.  (Its own CPU
  time alone misses the threads it starves: at the unit's nice -5 the
  scheduler rarely preempts it for them.)  So a learner
  whose gather leaves the other core idle (dqn-atari's 2.2 ms between
  samples on 2 cores) keeps its daemon awake, and one whose training step
  wants every core (the drop-in loop's torch update) gets it back within
  a fraction of a millisecond, at most once per back-off.
* no learner spin takes a core a runnable thread waits for, however
  often the learner samples: while more threads are runnable than the
  machine has CPUs (read as the spin starts, then every
  ``RUNQUEUE_EVERY_S`` past the plain budget; ``crowded_spins`` counts
  them) the spin is cut back to the plain budget, and a watched one backs
  off.  A CleanRL loop on a faster 2-core box samples every ~1 ms, under
  ``learner_spin_us``: that spin held a core through every torch update
  (which wants both) and every env step (torch's OpenMP worker spins on
  the other core between operations), and the loop ran at 0.58-0.82x the
  in-process buffer's env steps/s against 0.80-1.11x with this rule
  (docs/performance.md, "A learner spin that takes nobody's core").  The
  plain budget is left alone: cut when crowded as well, the prefetching
  learner (its gather thread, its update, the daemon) lost 7% of its
  batches.
* no learner spin follows a wide SAMPLE (``records.WIDE``): its client
  copies the batch on every CPU it has (a large batch on a small box,
  client/gather.py), so the spin would take a core from that copy for as
  long as it lasted, and the run queue, read as the spin starts, cannot
  see a copy that the reply is only about to start (a dqn-atari sample +
  update on 2 CPUs gained 10-18% with the split and this rule, and nothing
  with the split alone; docs/performance.md, ninth pass).  The plain
  budget stays: the learner's next request wakes the engine.
  The spin does not yield the CPU: measured on
  2 cores with 2 actors flat out (dqn rows), a spin that called
  ``sched_yield`` after 20 us handed a whole time slice to an actor each
  time, and the learner fell from ~300 to ~215 batches/s (inserts rose
  from ~68k to ~121k/s); the daemon's priority (``Nice=-5`` in the unit)
  and the actors' (+5) set that split on purpose.

Lazy COMMITs.  What wakes the spin, or keeps the engine serving after a
pass, is a record that wants an answer (or a call): a client's COMMITs,
fewer than ``LAZY_MAX`` in its ring, wait for its next such request
(a sample, a reservation, a flush), which the engine serves together with
them, in one run (``Ring.wants_service``; ``LAZY_MAX`` of them are served
at once).  Served one by one as they came, which a daemon kept up by a
learner did, a CleanRL loop's single inserts cost ~100 us of daemon CPU
each, run cold between two env steps: ~4 commit runs per sample where one
does (docs/performance.md, "Lazy COMMITs wait for the next request").
While requests are parked every record is served at once: a parked
sample may be waiting for exactly that commit.  COMMITs left waiting when
the engine sleeps are served at the next wake, the idle timeout's at the
latest (a client's ``flush()`` wakes it).  COMMITs that keep coming
within the spin budget keep the spin going as work would, and teach it
their gap: a writer flat out finds the daemon up, as before, instead of
ringing it every ``LAZY_MAX`` inserts; a CleanRL loop's, ~330 us apart,
let it sleep.

Then the engine announces sleep in every ring and waits in ``epoll`` on
every client's doorbell (an eventfd only that client and the daemon hold)
and its own (rung by the control plane), which clients ring when they see
the announcement (docs/protocol.md, "Waking"); an idle engine uses no CPU.
A COMMIT nobody waits for (a lazy one, the default) leaves it asleep: the
next request that wants an answer (a sample, a flush) wakes it, and it
applies every record before it.  While requests are parked the
announcement says so (``ASLEEP_WAITING``), and every record wakes it: a
parked sample may be waiting for exactly that commit.
Whatever a client writes into its own eventfd can only wake the engine
early: nothing it does to it can make the engine's wait fail.

Engine thread only.
"""

from __future__ import annotations

import os
import select
import time

from ...wire.channel import ASLEEP, ASLEEP_WAITING, LAZY_MAX
from ...wire.doorbell import drain


BURST_S = 50e-6
# a spin kept up for a learner past learner_spin_us ends once its thread has
# been off the CPU this long (someone else needed the core), and such spins
# stop for BACKOFF_S
CONTENDED_S = 200e-6
BACKOFF_S = 0.5
RUNQUEUE_EVERY_S = 100e-6  # how often a watched spin reads the run queue


def runnable_threads(fd: int) -> int:
    """Threads running or waiting for a CPU on the machine now, the calling
    one included (the 4th field of /proc/loadavg, "running/total"), read
    through ``fd``; 0 if it does not read."""
    try:
        return int(os.pread(fd, 64, 0).split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 0


class Idler:
    def __init__(self, bell: int, spin_us: float, idle_timeout: float, learner_spin_us: float = 0.0,
                 learner_spin_max_us: float = 0.0):
        self.epoll = select.epoll()
        self.epoll.register(bell, select.EPOLLIN)
        self.bell = bell  # the control plane's; every other watched fd is a client's doorbell
        self.spin_max = spin_us * 1e-6
        self.spin_min = min(2e-6, self.spin_max)
        self.spin_s = self.spin_max
        self.burst_s = min(BURST_S, self.spin_max)
        self.learner_spin = learner_spin_us * 1e-6
        # 0 learner_spin_us turns learner spins off, the watched ones too
        self.learner_spin_max = learner_spin_max_us * 1e-6 if learner_spin_us > 0 else 0.0
        self.backoff_until = 0.0  # perf_counter before which no watched learner spin starts
        try:  # kept open: a watched spin reads it every RUNQUEUE_EVERY_S
            self.loadavg = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.loadavg = -1  # no /proc: the engine's own CPU time alone decides
        self.cpus = os.cpu_count() or 1
        self.last_sample = -1.0   # perf_counter of the last pass that answered a SAMPLE
        self.sample_gap = float("inf")
        self.wide = False  # the last SAMPLE answered was a wide one (sampled)
        self.idle_since = 0.0  # when the last fruitless spin began
        self.idle_timeout = idle_timeout
        # wakeups: sleeps a doorbell ended (not the timeout); client_wakeups:
        # those a client's doorbell was among (the control plane's bell rings
        # for every stats/status call, the monitor's look once a second, a
        # sync: those wake the engine too, and are not a client's)
        self.stats = {"wakeups": 0, "client_wakeups": 0, "sleeps": 0, "learner_spins": 0,
                      "watched_learner_spins": 0, "contended_spins": 0, "crowded_spins": 0,
                      "wide_samples": 0}

    def sampled(self, now: float | None = None, wide: bool = False) -> None:
        """The engine answered a SAMPLE in this pass (at ``now``,
        perf_counter); ``wide``: one whose client copies it on every CPU
        (``records.WIDE``), which no learner spin may take one of until the
        next SAMPLE is answered."""
        now = time.perf_counter() if now is None else now
        if self.last_sample >= 0:
            self.sample_gap = now - self.last_sample
        self.last_sample = now
        self.wide = wide
        self.stats["wide_samples"] += wide

    def learner_until(self, now: float) -> tuple[float, bool]:
        """Until when to stay up for a learner: (perf_counter time, watched),
        0.0 for not at all; ``watched``: a spin past ``learner_spin_us``,
        which ends once it costs another thread its core (``contended``)."""
        if self.wide:  # the learner copies its batch on every CPU now: leave them to it
            return 0.0, False
        gap = self.sample_gap
        if gap < self.learner_spin:
            return self.last_sample + 2 * gap, False
        if gap < self.learner_spin_max and now >= self.backoff_until:
            return self.last_sample + 2 * gap, True
        return 0.0, False

    def contended(self, now: float) -> None:
        """A watched spin lost its core: sleep, and start none for BACKOFF_S."""
        self.backoff_until = now + BACKOFF_S
        self.stats["contended_spins"] += 1

    def spin(self, rings: list, calls, worked: bool = False, waiting: bool = False,
             start: float | None = None) -> bool:
        """Re-check the rings (and the call queue) for up to the spin
        budget (``worked``: the last pass did work); True if something
        arrived that wants serving now (``wanted``).  ``start``: the
        perf_counter time the spin counts from (now; a test pins it, so
        which spin it is does not depend on how long it was descheduled)."""
        if not rings:
            return False
        start = time.perf_counter() if start is None else start
        deadline = start + max(self.spin_s, self.burst_s if worked else 0.0) if self.spin_max > 0 else start
        plain = deadline
        until, watched = self.learner_until(start)  # a learner samples often: stay up for it
        if until > deadline:
            deadline = until
            self.stats["watched_learner_spins" if watched else "learner_spins"] += 1
        else:
            watched = False
        if deadline <= start:
            return False
        if deadline > plain and self.crowded():  # staying up for a learner would take a core
            self._crowded_out(watched)            # a runnable thread waits for: the plain spin only
            deadline, watched = plain, False
            if deadline <= start:
                return False
        cpu0 = time.thread_time() if watched else 0.0
        look = start + RUNQUEUE_EVERY_S
        left = sum([r.lazy_to for r in rings])  # COMMITs left waiting so far
        last = start
        while True:
            now = time.perf_counter()
            if self.wanted(rings, calls, waiting):
                self._learn_gap(now - start)
                return True
            seen = sum([r.lazy_to for r in rings])
            if seen != left:  # COMMITs came and wait: a writer is busy; stay up while it is
                left = seen
                self._learn_gap(now - last)
                last = now
                if self.spin_s > self.spin_min:  # they come within the budget: as work would
                    deadline = max(deadline, now + self.spin_s)
            if now >= deadline:
                self.idle_since = start
                return False
            # past the plain budget (a learner's spin, or one a writer's
            # COMMITs kept going) a spin ends once it costs someone a core
            # (more threads runnable than CPUs); a watched one also once
            # this thread was kept off its core CONTENDED_S in all
            if now > plain and now >= look:
                look = now + RUNQUEUE_EVERY_S
                if self.crowded():
                    self._crowded_out(watched)
                    self.idle_since = start
                    return False
                if watched and (now - start) - (time.thread_time() - cpu0) > CONTENDED_S:
                    self.contended(now)
                    self.idle_since = start
                    return False

    def crowded(self) -> bool:
        """More threads runnable on the machine than it has CPUs (this one
        included): a spin would keep one of them off a core."""
        return self.loadavg >= 0 and runnable_threads(self.loadavg) > self.cpus

    def _crowded_out(self, watched: bool) -> None:
        """A spin past the plain budget is cut because the machine is
        crowded: counted, and a watched learner spin backs off too."""
        self.stats["crowded_spins"] += 1
        if watched:
            self.contended(time.perf_counter())

    @staticmethod
    def wanted(rings: list, calls, waiting: bool) -> bool:
        """Does a ring or the call queue hold something to serve now?
        COMMITs wait, fewer than ``LAZY_MAX`` of a client, for its next
        request that wants an answer (``Ring.wants_service``), unless
        requests are parked (``waiting``: a COMMIT may be what one waits
        for).  Never raises: errors surface where rings are served."""
        limit = 1 if waiting else LAZY_MAX
        for r in rings:
            if r.wants_service(limit):
                return True
        return not calls.empty()

    def _learn_gap(self, gap: float) -> None:
        self.spin_s = min(self.spin_max, 2 * gap) if gap < self.spin_max else self.spin_min
        self.spin_s = max(self.spin_min, self.spin_s)

    def watch(self, fd: int) -> None:
        """A client's doorbell: wake when it rings."""
        self.epoll.register(fd, select.EPOLLIN)

    def unwatch(self, fd: int) -> None:
        if not self.epoll.closed:  # a client dropped after the engine stopped
            self.epoll.unregister(fd)

    def close(self) -> None:
        self.epoll.close()
        if self.loadavg >= 0:
            os.close(self.loadavg)
            self.loadavg = -1

    def sleep(self, rings: list, calls, deadline: float | None, waiting: bool = False) -> None:
        """Sleep until a client or a call rings a doorbell, the idle
        timeout passes, or ``deadline`` (a parked request's) comes.
        ``waiting``: requests are parked, which any record may unblock, so
        every client is told to wake the engine even for a lazy COMMIT;
        else COMMITs the spin left waiting do not keep it up."""
        word = ASLEEP_WAITING if waiting else ASLEEP
        try:
            if any([r.set_sleeping(word, not waiting) for r in rings]) or not calls.empty():
                return
            self.stats["sleeps"] += 1
            timeout = self.idle_timeout
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            rang = self.epoll.poll(timeout)
            for fd, _ in rang:
                drain(fd)
            if rang:
                self.stats["wakeups"] += 1
                if any(fd != self.bell for fd, _ in rang):
                    self.stats["client_wakeups"] += 1
                self._learn_gap(time.perf_counter() - self.idle_since)
        finally:
            for r in rings:
                r.clear_sleeping()
