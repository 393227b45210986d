"""The inference channel when something goes wrong: envs that die (idle,
with a request posted, while a batch fills), a server that closes or dies,
a process that scribbles over the shared words.  Real processes; each test
arranges the state it checks and waits for it with a hang guard."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import shmreplay
from inferencekit import (FORK, PREFIX, env_main, env_until_told, policy, raw_ctrl, raw_header, reachable, serve,
                          serve_env, server, shm_names, state, token_of)
from shmreplay.inference import futex
from shmreplay.inference import layout as wi
from shmreplay.wire import atomics
from waiting import HANG_S, reap, wait_for


def test_dead_envs_are_reported_lost_and_their_slots_reused():
    with server(slots=2) as srv:
        go, hold = FORK.Event(), FORK.Event()
        busy = FORK.Process(target=env_until_told, args=(srv.address, go, 1))
        idle = FORK.Process(target=env_until_told, args=(srv.address, go, 0, hold))
        new = None
        try:
            busy.start()
            idle.start()
            assert srv.wait_attached(2, timeout=HANG_S) == 2
            go.set()
            b = srv.receive(timeout=HANG_S)  # busy's request, taken, not answered
            busy.kill()   # SIGKILL, not reaped: a zombie counts as dead
            idle.kill()
            lost: list[int] = []
            while len(lost) < 2:
                more = srv.receive(timeout=HANG_S)
                assert len(more) == 0, "a dead env posted nothing more"
                lost += more.lost.tolist()
            assert sorted(lost) == [0, 1] and srv.stats()["lost"] == 2
            srv.respond(b.slots, action=[7])  # its env is gone: skipped, no error
            assert srv.stats()["served"] == 0 and srv.stats()["attached"] == 0
            busy.join(HANG_S)
            idle.join(HANG_S)
            # both slots are free for new envs; the one that was pending works too
            new = [FORK.Process(target=env_main, args=(srv.address, i, 20)) for i in (5, 6)]
            for p in new:
                p.start()
            serve(srv, 40)
            for p in new:
                p.join(HANG_S)
            assert [p.exitcode for p in new] == [0, 0]
        finally:
            reap([busy, idle, *(new or [])])


def test_an_env_killed_with_its_request_posted_is_lost_not_hung():
    with server(slots=1) as srv:
        go = FORK.Event()
        env = FORK.Process(target=env_until_told, args=(srv.address, go, 1))
        try:
            env.start()
            srv.wait_attached(1, timeout=HANG_S)
            ctrl = raw_ctrl(srv.address)
            go.set()
            wait_for(lambda: state(ctrl, 0)[1] == wi.POSTED, "the env's request posted")
            env.kill()
            env.join(HANG_S)
            seen = []
            while not seen:
                b = srv.receive(timeout=HANG_S)
                seen = b.lost.tolist()
                assert not set(seen) & set(b.slots.tolist())
                if len(b):  # taken before its death was seen: answering it is harmless
                    srv.respond(b.slots, action=[0])
            assert seen == [0] and state(ctrl, 0) == (0, 0)
        finally:
            reap([env])


def closed_env(address: str, ready) -> None:
    with shmreplay.InferenceClient(address, timeout=HANG_S) as ch:
        ready.set()
        try:
            ch.call(obs=[1, 2, 3, 4], reward=0, done=False)
        except shmreplay.InferenceClosed as exc:
            assert "closed" in str(exc), exc
            # and so does every later call
            with pytest.raises(shmreplay.InferenceClosed):
                ch.call(obs=[1, 2, 3, 4], reward=0, done=False)
            os._exit(0)
    os._exit(3)


def test_server_close_wakes_a_waiting_env_with_a_clear_error():
    srv = server(slots=1)
    ready = FORK.Event()
    env = FORK.Process(target=closed_env, args=(srv.address, ready))
    try:
        env.start()
        ready.wait(HANG_S)
        srv.receive(timeout=HANG_S)  # taken: its env waits for the reply
        srv.close()
        assert not reachable(srv.address)
        env.join(HANG_S)
        assert env.exitcode == 0
        with pytest.raises(shmreplay.InferenceClosed, match="no inference channel"):
            shmreplay.InferenceClient(srv.address)
        with pytest.raises(shmreplay.InferenceClosed, match="closed"):
            srv.receive(timeout=0)
    finally:
        reap([env])
        srv.close()


def dying_server(conn, seal: bool) -> None:
    """A learner that takes one request and is then SIGKILLed."""
    srv = server(slots=2)
    conn.send(srv.address)
    srv.wait_attached(1, timeout=HANG_S)
    if seal:
        srv.seal()
    srv.receive(timeout=HANG_S)
    conn.send("taken")
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("seal", [True, False])
def test_a_dead_server_is_reported_to_its_waiting_env(seal):
    mine, theirs = FORK.Pipe()
    learner = FORK.Process(target=dying_server, args=(theirs, seal))
    address = None
    try:
        learner.start()
        address = mine.recv()
        with shmreplay.InferenceClient(address, timeout=HANG_S) as ch:
            with pytest.raises(shmreplay.InferenceClosed, match=r"died: its learner is gone"):
                ch.call(obs=[0, 0, 0, 0], reward=0, done=False)
            assert mine.recv() == "taken"
        learner.join(HANG_S)
        assert learner.exitcode == -signal.SIGKILL
        # sealed or not, the crash left nothing: the channel had no name, and
        # its memory goes with the last mapping (this env's, closed above)
        assert not reachable(address) and shm_names(PREFIX, token_of(address)) == set()
    finally:
        reap([learner])


def scribbler(address: str, spare: list, go, done, hold) -> None:
    """A hostile env: attaches, then writes garbage over its own slot, the
    free slots, the start words and the sleeping words, and floods the
    doorbell (rings it, and writes garbage into it)."""
    rng = np.random.default_rng(1)
    ch = shmreplay.InferenceClient(address)
    ctrl, hdr = raw_ctrl(address), raw_header(address)
    bell = futex.word_address(hdr, wi.H_SLEEPING)
    targets = [ch.slot, *spare]
    go.wait(HANG_S)
    me, dead = os.getpid(), 4_000_000
    choices = [lambda: int(rng.integers(0, 2**63)), lambda: wi.word(me, 0x7F),
               lambda: wi.word(1, wi.POSTED), lambda: wi.word(dead, wi.POSTED),
               lambda: wi.word(os.getppid(), wi.IDLE), lambda: wi.word(me, wi.TAKEN),
               lambda: wi.word(me, wi.POSTED), lambda: wi.word(me, wi.DONE),
               lambda: wi.word(1, wi.ATTACHING)]
    for i in range(20_000):
        k = targets[i % len(targets)]
        atomics.store(ctrl, k * wi.SLOT_WORDS, choices[int(rng.integers(len(choices)))]())
        if i % 3 == 0:
            atomics.store(ctrl, k * wi.SLOT_WORDS + wi.W_START, int(rng.integers(0, 2**63)))
            atomics.store(ctrl, k * wi.SLOT_WORDS + wi.W_SLEEPS, int(rng.integers(0, 2**63)))
        if i % 10 == 0:
            wi.ring(hdr, bell)
        elif i % 10 == 5:
            atomics.store(hdr, wi.H_SLEEPING, int(rng.integers(0, 2**63)))
    # and leave garbage behind: an unknown code in its own slot, a dead pid's request in a spare one
    atomics.store(ctrl, ch.slot * wi.SLOT_WORDS, wi.word(me, 0x7F))
    atomics.store(ctrl, spare[0] * wi.SLOT_WORDS, wi.word(dead, wi.POSTED))
    done.set()
    hold.wait(HANG_S * 10)  # killed by the test


def test_garbage_in_the_shared_words_does_not_stop_the_server():
    with server(slots=4) as srv:
        go, done, hold = FORK.Event(), FORK.Event(), FORK.Event()
        legit = [FORK.Process(target=env_until_told, args=(srv.address, go, 200)) for _ in range(2)]
        hostile = None
        try:
            for p in legit:
                p.start()
            srv.wait_attached(2, timeout=HANG_S)
            ctrl = raw_ctrl(srv.address)
            held = {k for k in range(4) if state(ctrl, k)[0] in {p.pid for p in legit}}
            assert len(held) == 2
            hostile = FORK.Process(target=scribbler, args=(srv.address, sorted(set(range(4)) - held)[1:],
                                                           go, done, hold))
            hostile.start()
            srv.wait_attached(3, timeout=HANG_S)
            go.set()
            # the two honest envs get every answer right while the third scribbles
            served = 0
            while served < 400 or not done.is_set():
                try:
                    b = srv.receive(max_wait_s=0.001, timeout=HANG_S if served < 400 else 0.05)
                except shmreplay.ReplayTimeout:
                    continue
                honest = np.isin(b.slots, sorted(held))
                srv.respond(b.slots, action=np.where(honest, policy(b.data["obs"]), -1))
                served += int(honest.sum())
            for p in legit:
                p.join(HANG_S)
            assert [p.exitcode for p in legit] == [0, 0]
            hostile.kill()
            hostile.join(HANG_S)
            # the garbage it left is cleared: its slot and the spare one free up
            while srv.stats()["attached"] or any(state(ctrl, k) != (0, 0) for k in range(4)):
                try:
                    b = srv.receive(timeout=0.05)
                    srv.respond(b.slots, action=np.zeros(len(b), np.int64))
                except shmreplay.ReplayTimeout:
                    pass
            assert srv.stats()["garbage"] > 0  # its last words at least
            with shmreplay.InferenceClient(srv.address) as a, shmreplay.InferenceClient(srv.address) as c:
                assert {a.slot, c.slot} <= set(range(4))
        finally:
            reap([*legit, *([hostile] if hostile else [])])


def test_an_env_dying_while_a_batch_fills_is_dropped_from_it():
    import threading
    with server(slots=2) as srv:
        go = FORK.Event()
        env = FORK.Process(target=env_until_told, args=(srv.address, go, 1))
        try:
            env.start()
            srv.wait_attached(1, timeout=HANG_S)
            ctrl = raw_ctrl(srv.address)
            go.set()

            def kill_once_taken():
                wait_for(lambda: state(ctrl, 0) == (env.pid, wi.TAKEN), "its request taken")
                env.kill()

            killer = threading.Thread(target=kill_once_taken)
            killer.start()
            # waits for a second request that never comes: the death ends the wait
            b = srv.receive(min_batch=2, max_wait_s=HANG_S, timeout=HANG_S)
            killer.join(HANG_S)
            assert b.lost.tolist() == [0] and len(b) == 0 and b.data["obs"].shape == (0, 4)
            assert state(ctrl, 0) == (0, 0)
            srv.respond(b.slots, action=np.zeros(0, np.int64))  # nothing to answer
            serve_env(srv, 3, 5)  # and a new env is served
        finally:
            reap([env])


def attach_to_the_freed_slot(address: str, slot: int) -> None:
    """Once the server freed ``slot`` (its env died), attach to it (the
    first free slot) and call once."""
    ctrl = raw_ctrl(address)
    wait_for(lambda: state(ctrl, slot) == (0, 0), "the dead env's slot freed")
    with shmreplay.InferenceClient(address, timeout=HANG_S) as ch:
        assert ch.slot == slot
        out = ch.call(obs=[7, 1, 0, 0], reward=0.0, done=False)
        assert int(out["action"]) == 7 * 100_000 + 1, out


def attach_once_taken(address: str, slot: int, hold) -> None:
    """Attach once the server took the request in ``slot``; stay until ``hold``."""
    ctrl = raw_ctrl(address)
    wait_for(lambda: state(ctrl, slot)[1] == wi.TAKEN, "the new env's request taken")
    with shmreplay.InferenceClient(address, timeout=HANG_S):
        hold.wait(HANG_S * 10)


def test_a_new_envs_request_in_a_lost_slot_is_served_not_dropped():
    """An env dies while the learner waits for envs to attach; a new env
    takes its freed slot and posts, and wait_attached takes that request
    (then a third env attaches and the wait ends).  The receive that tells
    the loss must not drop the new env's request as the dead env's: it is
    returned by the next receive and answered.  (Before: dropped, the new
    env's word TAKEN for good, its call never answered.)"""
    with server(slots=2) as srv:
        go, hold = FORK.Event(), FORK.Event()
        dead = FORK.Process(target=env_until_told, args=(srv.address, go, 0, hold))
        new = FORK.Process(target=attach_to_the_freed_slot, args=(srv.address, 0))
        third = FORK.Process(target=attach_once_taken, args=(srv.address, 0, hold))
        try:
            dead.start()
            assert srv.wait_attached(1, timeout=HANG_S) == 1
            dead.kill()
            dead.join(HANG_S)
            new.start()
            third.start()
            # slot 0 lost, the new env's request in it taken, the third env in slot 1
            assert srv.wait_attached(2, timeout=HANG_S) == 2
            told = srv.receive(timeout=0)
            assert told.lost.tolist() == [0] and len(told) == 0
            b = srv.receive(timeout=0)  # taken already: no wait
            assert b.slots.tolist() == [0] and b.lost.tolist() == []
            srv.respond(b.slots, action=policy(b.data["obs"]))
            new.join(HANG_S)
            assert new.exitcode == 0
            assert (srv.stats()["lost"], srv.stats()["served"]) == (1, 1)
        finally:
            hold.set()
            reap([dead, new, third])


def test_wait_attached_sleeps_again_once_an_env_was_lost():
    """A loss found during wait_attached is kept for the next receive; the
    wait goes on sleeping on the doorbell (stats()["sleeps"] counts each
    sleep) instead of looking again at once.  (Before: no sleep from the
    loss on, one core busy until enough envs attached.)"""
    import threading
    with server(slots=2) as srv:
        go, hold = FORK.Event(), FORK.Event()
        dead = FORK.Process(target=env_until_told, args=(srv.address, go, 0, hold))
        later = [FORK.Process(target=env_until_told, args=(srv.address, go, 0, hold)) for _ in range(2)]
        waited = []
        waiter = threading.Thread(target=lambda: waited.append(srv.wait_attached(2, timeout=HANG_S)))
        try:
            dead.start()
            srv.wait_attached(1, timeout=HANG_S)
            dead.kill()
            dead.join(HANG_S)
            waiter.start()
            wait_for(lambda: srv.stats()["lost"] == 1, "the dead env found by wait_attached")
            seen = srv.stats()["sleeps"]
            wait_for(lambda: srv.stats()["sleeps"] >= seen + 3, "wait_attached sleeping after the loss")
            for p in later:
                p.start()
            waiter.join(HANG_S)
            assert waited == [2]
            assert srv.receive(timeout=0).lost.tolist() == [0]
        finally:
            hold.set()
            reap([dead, *later])
            if waiter.ident:
                waiter.join(HANG_S)


def channel_maps(address: str) -> int:
    """This process's mappings of the channel at ``address`` (by its inode;
    earlier tests' channels may be unmapped meanwhile)."""
    ino = str(os.stat(address.split("#")[0]).st_ino)
    with open("/proc/self/maps") as f:
        return sum(PREFIX in line and line.split()[4] == ino for line in f)


@pytest.mark.parametrize("why", ["full", "closed", "layout"])
def test_a_failed_attach_leaves_no_mapping(why):
    """An env that tries again and again to attach, keeping each error
    (a retry loop that reports the last), holds no mapping of the channel
    for any: each failure unmaps it before raising.  (Before: one mapping
    per try, alive as long as its traceback.)"""
    expected = {"full": shmreplay.CapacityError, "closed": shmreplay.InferenceClosed,
                "layout": shmreplay.LayoutError}[why]
    with server(slots=1) as srv:
        hdr = raw_header(srv.address)
        with shmreplay.InferenceClient(srv.address, timeout=HANG_S):  # the channel's one slot
            if why == "closed":  # the server's word, as any process of the user can write it
                atomics.store(hdr, wi.H_STATE, wi.CLOSED)
            elif why == "layout":
                atomics.store(hdr, wi.H_VERSION, 0)
            before = channel_maps(srv.address)
            errors = []
            for _ in range(5):
                with pytest.raises(expected) as e:
                    shmreplay.InferenceClient(srv.address, timeout=HANG_S)
                errors.append(e.value)
            assert channel_maps(srv.address) == before, errors[-1]
