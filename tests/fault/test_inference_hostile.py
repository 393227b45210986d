"""Issue 34, items 1 and 7: a hostile env of the learner's own user
writes whatever it likes into the inference channel's segment
(docs/reliability.md, section 9).

Envs of one channel run as one user, so each can write every byte of the
segment: the header, every slot's words, the bells, the requests and the
responses.  The promise is about the server: nothing written there
crashes it, wedges it or makes it raise; a slot whose word is no state
word is taken back as a dead env's; and an honest env gets answers or a
clear shmreplay error, after which it attaches again.  The learner runs in
a process of its own in each test, so that a crash (the glibc abort of the
semaphores before) is an exit status, not the end of the test run.  No
assertion depends on timing: hang guards only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

import numpy as np

import shmreplay
from inferencekit import FORK, env_main, raw_ctrl, raw_segment, reachable, serve_env, server, state
from shmreplay.inference import futex
from shmreplay.inference import layout as wi
from shmreplay.wire import atomics
from waiting import HANG_S, reap, wait_for


def safe_policy(obs: np.ndarray) -> np.ndarray:
    """The suite's policy (each env's action a function of its own
    observation), for any float a scribbler left in a request too."""
    o = np.nan_to_num(obs[..., :2], nan=0.0, posinf=0.0, neginf=0.0).clip(-1e6, 1e6).astype(np.int64)
    return o[..., 0] * 100_000 + o[..., 1]


def learner(conn, slots: int) -> None:
    """A learner process: serves until the test says, then sends its stats
    and whether its address still names the channel once closed; any
    error ends it with exit 1."""
    with server(slots=slots) as srv:
        conn.send(srv.address)
        while not conn.poll(0):
            try:
                b = srv.receive(max_wait_s=0.001, timeout=0.05)
            except shmreplay.ReplayTimeout:
                continue
            srv.respond(b.slots, action=safe_policy(b.data["obs"]))
        conn.recv()
        stats = srv.stats()
    conn.send((stats, reachable(srv.address)))


class Learner:
    """tests' handle of a ``learner`` process."""

    def __init__(self, slots: int):
        self.conn, theirs = FORK.Pipe()
        self.proc = FORK.Process(target=learner, args=(theirs, slots))
        self.proc.start()
        assert self.conn.poll(HANG_S), "the learner said nothing"
        self.address = self.conn.recv()

    def end(self) -> dict:
        """Its stats, once it closed its channel and exited 0 (a crash: its
        exit status in the assert)."""
        assert self.proc.is_alive(), f"the learner died: exit {self.proc.exitcode}"
        self.conn.send("end")
        assert self.conn.poll(HANG_S), "the learner did not answer"
        stats, left = self.conn.recv()
        self.proc.join(HANG_S)
        assert self.proc.exitcode == 0 and not left, (self.proc.exitcode, left)
        return stats

    def close(self) -> None:
        reap([self.proc])


def poison_bells(address: str, slot: int) -> list[str]:
    """The report's attack: 0xff over the doorbell and over slot ``slot``'s
    reply bell: the words the doc gives (header word 15; the slot's state
    word and the words after it, 16 bytes; version 1's were semaphores
    ``sem.<name>.d`` and ``.r<i>``).  What it wrote."""
    buf = raw_segment(address)
    lay, _, _ = wi.read_layout(buf, address)
    bell = wi.H_SLEEPING * 8
    line = lay.ctrl + slot * wi.LINE
    buf[bell:bell + 8] = b"\xff" * 8
    buf[line:line + 16] = b"\xff" * 16
    return ["doorbell word", f"slot {slot}'s words"]


def poisoner(address: str) -> None:
    """The rogue env: attaches, writes 0xff over both bells, rings the
    doorbell, and leaves its poisoned slot as it is."""
    rogue = shmreplay.InferenceClient(address, timeout=HANG_S)
    assert "doorbell word" in poison_bells(address, rogue.slot)
    bell = futex.word_address(np.frombuffer(raw_segment(address), np.uint64), wi.H_SLEEPING)
    for _ in range(3):
        futex.wake(bell)
    os._exit(0)  # no close: the word stays until the server takes the slot back


def test_garbage_in_the_bells_never_kills_the_learner():
    """Issue 34, item 1: "an env process of the same user that writes 4
    bytes into the doorbell semaphore, or 16 into its own reply semaphore,
    kills the learner with SIGABRT".  A rogue env attaches, writes 0xff
    over both bells and rings; the learner lives and takes the rogue's slot
    back (its word is no state word: counted as garbage), and an honest env
    attaching afterwards gets every answer right.  On the code before, the
    learner died of glibc's futex abort (exit -6) at its next sleep."""
    lrn = Learner(slots=2)
    rogue = env = None
    try:
        rogue = FORK.Process(target=poisoner, args=(lrn.address,))
        rogue.start()
        rogue.join(HANG_S)
        assert rogue.exitcode == 0
        env = FORK.Process(target=env_main, args=(lrn.address, 4, 30))
        env.start()
        env.join(HANG_S)
        assert env.exitcode == 0
        stats = lrn.end()
        assert stats["served"] == 30 and stats["garbage"] >= 1, stats
    finally:
        reap([p for p in (rogue, env) if p is not None])
        lrn.close()


def test_a_word_too_large_for_a_pid_in_a_free_slot_is_freed_not_raised():
    """Issue 34, item 1: "writing (1<<63)|IDLE into a free slot's state word
    (after any env has died once) makes receive() raise OverflowError, and
    the honest env never gets another answer after the word is cleared".
    Here an env dies once, the word is written into its freed slot, and
    the server serves an honest env from its other slot: receive() never
    raises, the word is counted as garbage and the slot freed (it reads
    FREE), and the honest env gets all its answers."""
    with server(slots=2) as srv:
        dying = FORK.Process(target=env_main, args=(srv.address, 1, 10 ** 9))
        try:
            dying.start()
            first = srv.receive(timeout=HANG_S)  # its request, taken
            dying.kill()
            dying.join(HANG_S)
            lost: list[int] = []
            while not lost:
                lost = srv.receive(timeout=HANG_S).lost.tolist()
            srv.respond(first.slots, action=[0])  # every batch is answered (its env's: skipped)
            ctrl = raw_ctrl(srv.address)
            (k,) = lost
            for bad in ((1 << 63) | wi.IDLE, (1 << 64) - 1, wi.word(wi.PID_MAX, wi.POSTED)):
                atomics.store(ctrl, k * wi.SLOT_WORDS, np.uint64(bad))
                garbage = srv.stats()["garbage"]
                while state(ctrl, k) != (0, 0):  # taken back at the server's next look
                    try:
                        srv.receive(timeout=0.05)
                    except shmreplay.ReplayTimeout:
                        pass
                assert srv.stats()["garbage"] == garbage + 1
            atomics.store(ctrl, k * wi.SLOT_WORDS, np.uint64((1 << 63) | wi.IDLE))  # and left there
            serve_env(srv, 2, 40)  # the honest env, on the other slot
        finally:
            reap([dying])


def test_an_env_whose_word_is_overwritten_while_it_waits_gets_a_clear_error():
    """The env's side of the same word: an env spinning on its posted
    request (a spin long enough that it is still spinning) finds a word
    too large for a pid in its slot; its call raises ``InferenceClosed``
    ("attach again"), never ``OverflowError``, and it attaches again and
    is served.  (Found by the scribble test below: the env handed the word
    it read to its next spin.)"""
    import threading
    with server(slots=2) as srv:
        ch = shmreplay.InferenceClient(srv.address, timeout=HANG_S, spin_us=HANG_S * 1e6)
        ctrl = raw_ctrl(srv.address)
        got = []

        def call():
            try:
                got.append(ch.call(obs=[1, 2, 0, 0], reward=0, done=False))
            except BaseException as exc:
                got.append(exc)
        t = threading.Thread(target=call, daemon=True)
        t.start()
        wait_for(lambda: state(ctrl, ch.slot) == (os.getpid(), wi.POSTED), "the request posted")
        atomics.store(ctrl, ch.slot * wi.SLOT_WORDS, np.uint64((1 << 63) | wi.IDLE))
        t.join(HANG_S)
        assert len(got) == 1 and isinstance(got[0], shmreplay.InferenceClosed), got
        assert "attach again" in str(got[0])
        ch.close()
        with shmreplay.InferenceClient(srv.address, timeout=HANG_S) as again:
            t = threading.Thread(target=lambda: got.append(again.call(obs=[3, 4, 0, 0], reward=0, done=False)))
            t.start()
            b = srv.receive(timeout=HANG_S)
            srv.respond(b.slots, action=safe_policy(b.data["obs"]))
            t.join(HANG_S)
        assert int(got[1]["action"]) == 300_004
        assert srv.stats()["garbage"] >= 1


SCRIBBLE_ROUNDS = 400
AFTER = 50  # calls each honest env makes once the scribbler stopped, every answer checked


def scribbler(address: str, seed: int, started) -> int:
    """A rogue env of the learner's user: attaches, then writes random bytes
    over every byte of the segment, SCRIBBLE_ROUNDS times, with the bells
    rung and 0xff'd between; leaves the last scribble there.  The rounds."""
    rng = np.random.default_rng(seed)
    ch = shmreplay.InferenceClient(address, timeout=1.0)
    buf = raw_segment(address)
    words = np.frombuffer(buf, np.uint64)
    lay, _, _ = wi.read_layout(buf, address)
    bells = [wi.H_SLEEPING] + [lay.ctrl // 8 + k * wi.SLOT_WORDS + w for k in range(lay.slots)
                               for w in (wi.W_STATE, wi.W_SLEEPS)]
    at = {b: futex.word_address(words, b) for b in bells}
    started.set()
    for i in range(SCRIBBLE_ROUNDS):
        buf[:] = rng.integers(0, 256, len(buf), dtype=np.uint8).tobytes()
        for b in bells:
            if i % 3 == 0:
                words[b] = np.uint64((1 << 64) - 1)
            futex.wake(at[b], futex.WAKE_ALL)
        if i % 50 == 0:  # and its own calls, through whatever it wrote
            try:
                ch.call(obs=[0, 0, 0, 0], reward=0, done=False)
            except shmreplay.ReplayError:
                pass
        time.sleep(0.001)  # the others run between two scribbles
    buf[:] = rng.integers(0, 256, len(buf), dtype=np.uint8).tobytes()
    return SCRIBBLE_ROUNDS


def honest_env(address: str, env_id: int, stopped, report) -> None:
    """Calls through the scribble, attaching again after every error (each
    must be a shmreplay error); once the scribbler stopped, attaches again
    and makes AFTER calls, each answer checked.  Reports its counts."""
    replies, errors, s, ch = 0, {}, 0, None
    guard = time.monotonic() + HANG_S * 3
    while not stopped.is_set():
        assert time.monotonic() < guard, "the scribble phase never ended"
        try:
            if ch is None:
                ch = shmreplay.InferenceClient(address, timeout=1.0)
            ch.call(obs=[env_id, s % 1000, 0, 0], reward=0, done=False)  # answers may be forged now
            replies, s = replies + 1, s + 1
        except shmreplay.ReplayError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            if ch is not None:
                ch.close()
            ch = None
            time.sleep(0.002)  # no hot loop while the channel is being scribbled
    if ch is not None:
        ch.close()
    ch = None

    def attach():
        nonlocal ch
        try:
            ch = shmreplay.InferenceClient(address, timeout=HANG_S)
        except shmreplay.ReplayError:  # the server mends its header and frees the slots at its next look
            return False
        return True
    wait_for(attach, "an attach once the scribbler stopped")
    with ch:
        for s in range(AFTER):
            out = ch.call(obs=[env_id, s, 0.5, -1], reward=s * 0.1, done=False)
            assert int(out["action"]) == env_id * 100_000 + s, (env_id, s, out)
    report.put((env_id, replies, errors))


def test_random_scribble_by_a_rogue_env_crashes_and_wedges_nobody():
    """Issue 34, item 7, the table scribble's bar for the channel
    (tests/fault/test_hostile_clients.py::test_random_scribble_by_a_member_
    changes_no_metadata_and_loses_no_item): a rogue env of the learner's
    user writes random bytes over every byte of the segment (header,
    schema, state words, bells, requests, responses), 400 times, while
    three honest envs call and the learner serves.  No process crashes or
    wedges; the learner answers on and ends cleanly; the honest envs get
    replies or shmreplay errors only, and attach again; once the scribbler
    stopped, each honest env attaches and gets 50 answers, all right.  The
    scribble's last round is left in place, so the learner must have seen
    garbage words and mended its header before anyone could attach again."""
    lrn = Learner(slots=6)
    started, stopped, report = FORK.Event(), FORK.Event(), FORK.Queue()
    honest = [FORK.Process(target=honest_env, args=(lrn.address, i + 1, stopped, report)) for i in range(3)]
    rogue = None
    try:
        for p in honest:
            p.start()
        rogue = FORK.Process(target=lambda: os._exit(0 if scribbler(lrn.address, 34, started) else 3))
        rogue.start()
        rogue.join(HANG_S * 3)
        assert rogue.exitcode == 0, f"the scribbler: exit {rogue.exitcode}"
        stopped.set()
        for p in honest:
            p.join(HANG_S * 2)
        assert [p.exitcode for p in honest] == [0, 0, 0]
        counts = sorted(report.get(timeout=HANG_S) for _ in honest)
        stats = lrn.end()
        print(f"\nscribbled {SCRIBBLE_ROUNDS} times; honest envs (id, replies, errors): {counts}; "
              f"learner: {stats}")
        assert stats["garbage"] >= 1 and stats["header_mended"] >= 1, stats
        assert stats["served"] >= 3 * AFTER, stats
    finally:
        reap([*honest, *([rogue] if rogue else [])])
        lrn.close()


F_SEAL_FUTURE_WRITE = 0x10  # linux/fcntl.h (5.1); Python's fcntl lacks it


def resize(address: str) -> dict:
    """What a process of the learner's user gets when it opens the channel
    through the learner's descriptor and tries to change its size (grow
    it, reserve past its end, shrink it to nothing) or its seals (a write
    seal would keep new envs from mapping it for writing): each call's
    errno, 0 if it did it."""
    fd = os.open(address.split("#")[0], os.O_RDWR)
    size = os.fstat(fd).st_size
    tries = {"grow": lambda: os.ftruncate(fd, size + 4096),
             "reserve past its end": lambda: os.posix_fallocate(fd, size, 4096),
             "add a seal": lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE),
             "shrink": lambda: os.ftruncate(fd, 0)}  # last: what it leaves is the attack
    got = {}
    try:
        for what, call in tries.items():
            try:
                call()
                got[what] = 0
            except OSError as exc:
                got[what] = exc.errno
    finally:
        os.close(fd)
    return got


def test_a_process_of_the_learners_user_cannot_resize_the_channel():
    """docs/reliability.md, section 9 (the residual of version 2): a process
    of the learner's own user opens the channel (the learner's descriptor,
    as an env does) and truncates it, grows it, reserves past its end, or
    adds a seal.  The channel is sealed (``F_SEAL_SHRINK | F_SEAL_GROW |
    F_SEAL_SEAL``) before it is mapped: each gets EPERM, and the learner
    and the honest envs, one attached before and one after, are served on.
    Without the seals (checked by removing them once) every call succeeds,
    the learner dies of SIGBUS at its next look (exit -7) and both envs
    fail (exit 1); the assert shows the exits."""
    lrn = Learner(slots=2)
    envs = [FORK.Process(target=env_main, args=(lrn.address, i + 1, 20)) for i in range(2)]
    try:
        envs[0].start()
        got = resize(lrn.address)
        envs[1].start()
        for p in envs:
            p.join(HANG_S)
        fates = (lrn.proc.exitcode, [p.exitcode for p in envs])
        assert got == dict.fromkeys(got, errno.EPERM), (got, "learner, envs: exit", fates)
        assert fates == (None, [0, 0]), fates
        stats = lrn.end()
        assert (stats["served"], stats["garbage"]) == (40, 0), stats
    finally:
        reap([*envs])
        lrn.close()

