"""The inference channel (SEED-style serving, no daemon): real env
processes (forked and spawned) and a server in this process or a child.

No assertion depends on timing: each test arranges the state it checks
(an env blocked in its call, a request taken and not answered, a process
killed) and waits for it with a hang guard (``waiting.wait_for``).
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal

import numpy as np
import posix_ipc
import pytest

import shmreplay
from shmreplay.wire import atomics
from shmreplay.wire import inference as wi
from waiting import HANG_S, reap, wait_for

PREFIX = f"shmreplay.test{os.getpid()}.inf"
REQUEST = {"obs": ("float32", (4,)), "reward": ("float32", ()), "done": ("bool", ())}
RESPONSE = {"action": ("int64", ())}
FORK = multiprocessing.get_context("fork")


def server(slots=4, **kw) -> shmreplay.InferenceServer:
    return shmreplay.InferenceServer(REQUEST, RESPONSE, slots=slots, prefix=PREFIX, **kw)


def names_of(address: str) -> set[str]:
    """What of channel ``address`` is in /dev/shm (segment and semaphores)."""
    base = address[1:]
    return {n for n in os.listdir("/dev/shm") if n == base or n.startswith(f"sem.{base}.")}


def policy(obs: np.ndarray) -> np.ndarray:
    """Each env's action is a function of its own observation."""
    return (obs[..., 0].astype(np.int64) * 100_000 + obs[..., 1].astype(np.int64))


def serve(srv, total: int, min_batch: int = 1) -> int:
    """Answer requests until ``total`` were served; the largest batch."""
    served = largest = 0
    while served < total:
        b = srv.receive(min_batch=min_batch, max_wait_s=0.001, timeout=HANG_S)
        srv.respond(b.slots, action=policy(b.data["obs"]))
        served += len(b)
        largest = max(largest, len(b))
    return largest


def env_main(address: str, env_id: int, steps: int) -> None:
    """An env process: ``steps`` calls, each reply checked against its own obs."""
    with shmreplay.InferenceClient(address, timeout=HANG_S) as ch:
        for s in range(steps):
            out = ch.call(obs=[env_id, s, 0.5, -1], reward=s * 0.1, done=(s % 7 == 0))
            assert out.keys() == {"action"} and out["action"].shape == ()
            assert int(out["action"]) == env_id * 100_000 + s, (env_id, s, out)


def env_until_told(address: str, go, steps: int, hold=None) -> None:
    """Attach, wait for ``go``, then ``steps`` calls (each answer checked);
    then, given ``hold``, stay attached until it is set (or the test kills it)."""
    with shmreplay.InferenceClient(address, timeout=HANG_S) as ch:
        go.wait(HANG_S)
        for s in range(steps):
            out = ch.call(obs=[ch.slot, s, 0, 0], reward=0.0, done=False)
            assert int(out["action"]) == ch.slot * 100_000 + s, (ch.slot, s, out)
        if hold is not None:
            hold.wait(HANG_S * 10)


def raw_ctrl(address: str) -> np.ndarray:
    """The channel's control words, mapped as any process of the user can."""
    shm = posix_ipc.SharedMemory(address)
    try:
        buf = mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()
    lay, _, _ = wi.read_layout(buf, address)
    return wi.views(buf, lay)[1]


def state(ctrl, slot: int) -> tuple[int, int]:
    w = int(atomics.load(ctrl, slot * wi.SLOT_WORDS))
    return w >> 8, w & 0xFF


def test_many_envs_forked_and_spawned_each_get_their_own_answers():
    with server(slots=6) as srv:
        assert names_of(srv.address) == {srv.address[1:]} | {
            f"sem.{srv.address[1:]}.{s}" for s in ["d", *(f"r{i}" for i in range(6))]}
        steps = 150
        procs = [FORK.Process(target=env_main, args=(srv.address, i, steps)) for i in range(4)]
        procs.append(multiprocessing.get_context("spawn").Process(
            target=env_main, args=(srv.address, 4, steps)))
        try:
            for p in procs:
                p.start()
            serve(srv, 5 * steps, min_batch=2)
            for p in procs:
                p.join(HANG_S)
            assert [p.exitcode for p in procs] == [0] * 5
        finally:
            reap(procs)
        st = srv.stats()
        assert (st["served"], st["lost"], st["garbage"]) == (5 * steps, 0, 0)
        # the envs closed: their slots are free again, none counted as lost
        with pytest.raises(shmreplay.ReplayTimeout):
            srv.receive(timeout=0.05)
        assert srv.stats()["attached"] == 0
    assert names_of(srv.address) == set()


def test_one_request_in_flight_per_env_and_a_full_channel_says_so():
    import threading
    with server(slots=2) as srv:
        go = FORK.Event()
        env = FORK.Process(target=env_until_told, args=(srv.address, go, 3))
        try:
            env.start()
            go.set()
            b = srv.receive(timeout=HANG_S)
            assert len(b) == 1 and b.data["obs"][0, 1] == 0
            # its env is blocked in its call: nothing more comes until we answer
            with pytest.raises(shmreplay.ReplayTimeout, match="no env posted"):
                srv.receive(timeout=0.2)
            # the second slot is this process's; a third env finds the channel full
            with shmreplay.InferenceClient(srv.address) as mine:
                with pytest.raises(shmreplay.CapacityError, match=r"full: all slots=2 are held"):
                    shmreplay.InferenceClient(srv.address)
                # one client, one call at a time: a second thread is refused
                got = {}
                t = threading.Thread(target=lambda: got.update(mine.call(obs=[9, 9, 0, 0], reward=0,
                                                                         done=True)))
                t.start()
                b2 = srv.receive(timeout=HANG_S)
                assert b2.slots.tolist() == [mine.slot]
                with pytest.raises(shmreplay.ReplayError, match="another thread is in call"):
                    mine.call(obs=[0, 0, 0, 0], reward=0, done=False)
                srv.respond(b2.slots, action=[42])
                t.join(HANG_S)
                assert int(got["action"]) == 42
            srv.respond(b.slots, action=policy(b.data["obs"]))
            serve(srv, 2)
            env.join(HANG_S)
            assert env.exitcode == 0
        finally:
            reap([env])


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
        assert names_of(srv.address) == set()
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
        # sealed, the crash left nothing; else its names stay (``shmreplay
        # cleanup`` removes them: the pid in the default prefix is dead)
        assert len(names_of(address)) == (0 if seal else 4)
    finally:
        reap([learner])
        if address is not None:
            wi.unlink_all(wi.all_names(address, 2), os.getpid())


def scribbler(address: str, spare: list, go, done, hold) -> None:
    """A hostile env: attaches, then writes garbage over its own slot, the
    free slots and the start words, and floods the doorbell."""
    rng = np.random.default_rng(1)
    ch = shmreplay.InferenceClient(address)
    ctrl = raw_ctrl(address)
    bell = posix_ipc.Semaphore(wi.doorbell_name(address))
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
        if i % 10 == 0:
            bell.release()
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


def test_seal_unlinks_every_name_and_attached_envs_go_on():
    with server(slots=2) as srv:
        go = FORK.Event()
        envs = [FORK.Process(target=env_until_told, args=(srv.address, go, 30)) for _ in range(2)]
        try:
            for p in envs:
                p.start()
            srv.wait_attached(2, timeout=HANG_S)
            srv.seal()
            assert names_of(srv.address) == set() and srv.stats()["sealed"]
            go.set()
            serve(srv, 60)
            for p in envs:
                p.join(HANG_S)
            assert [p.exitcode for p in envs] == [0, 0]
            with pytest.raises(shmreplay.InferenceClosed, match="sealed"):
                shmreplay.InferenceClient(srv.address)
        finally:
            reap(envs)


def test_timeouts_withdraw_or_drop_the_late_reply():
    import threading
    with server(slots=1) as srv, shmreplay.InferenceClient(srv.address, timeout=0.05) as ch:
        # never taken: withdrawn, so the server finds nothing
        with pytest.raises(shmreplay.ReplayTimeout, match="withdrawn"):
            ch.call(obs=[1, 0, 0, 0], reward=0, done=False)
        with pytest.raises(shmreplay.ReplayTimeout):
            srv.receive(timeout=0)
        # taken and answered late: the next call drops that answer.  Whether
        # the server takes the request before the env gives up is a race:
        # try until it does (a withdrawn one leaves nothing behind)
        for _ in range(100):
            errors = []

            def late():
                try:
                    ch.call(obs=[2, 0, 0, 0], reward=0, done=False)
                except shmreplay.ReplayTimeout as exc:
                    errors.append(str(exc))

            ch.timeout = 0.2
            t = threading.Thread(target=late)
            t.start()
            try:
                b = srv.receive(timeout=1.0)
            except shmreplay.ReplayTimeout:
                b = None
            t.join(HANG_S)
            assert len(errors) == 1 and ("withdrawn" in errors[0]) == (b is None), errors
            if b is not None:
                break
        assert "drops it" in errors[0]
        srv.respond(b.slots, action=[222])
        ch.timeout = HANG_S
        got = {}
        t = threading.Thread(target=lambda: got.update(ch.call(obs=[3, 0, 0, 0], reward=0, done=False)))
        t.start()
        b = srv.receive(timeout=HANG_S)
        assert b.data["obs"][0, 0] == 3
        srv.respond(b.slots, action=[333])
        t.join(HANG_S)
        assert int(got["action"]) == 333


def test_bad_input_gets_errors_that_say_what_to_do():
    with pytest.raises(shmreplay.SchemaError, match="dtype"):
        shmreplay.InferenceServer({"obs": ("str", (4,))}, RESPONSE, prefix=PREFIX)
    with pytest.raises(ValueError, match="slots=0"):
        shmreplay.InferenceServer(REQUEST, RESPONSE, slots=0, prefix=PREFIX)
    with pytest.raises(ValueError, match="prefix"):
        shmreplay.InferenceServer(REQUEST, RESPONSE, prefix="a/b")
    with pytest.raises(ValueError, match="address"):
        shmreplay.InferenceClient("/etc/passwd")
    with server(slots=2) as srv, shmreplay.InferenceClient(srv.address, timeout=0.01) as ch:
        for bad, match in [({"obs": [0] * 4, "reward": 0}, r"missing field\(s\) \['done'\]"),
                           ({"obs": [0] * 4, "reward": 0, "done": 0, "x": 1}, r"unknown field\(s\) \['x'\]"),
                           ({"obs": [0] * 3, "reward": 0, "done": 0}, r"shape \(3,\), expected \(4,\)"),
                           ({"obs": ["a"] * 4, "reward": 0, "done": 0}, "cannot be stored as float32")]:
            with pytest.raises(shmreplay.FieldError, match=match):
                ch.call(**bad)
        with pytest.raises(shmreplay.ReplayError, match="no request waiting"):
            srv.respond([0], action=[1])
        with pytest.raises(shmreplay.FieldError, match="slot 5 is not a distinct slot number"):
            srv.respond([5], action=[1])
        with pytest.raises(TypeError, match="pass its .address"):
            multiprocessing.reduction.ForkingPickler.dumps(srv)
        with pytest.raises(shmreplay.ReplayTimeout):
            ch.call(obs=[0] * 4, reward=0, done=True)
        ch.timeout = HANG_S
        import threading
        t = threading.Thread(target=lambda: ch.call(obs=[0] * 4, reward=0, done=True))
        t.start()
        b = srv.receive(timeout=HANG_S)
        with pytest.raises(shmreplay.FieldError, match="cannot be stored as int64"):
            srv.respond(b.slots, action=[0.5])
        with pytest.raises(shmreplay.FieldError, match=r"shape \(2,\), expected \(1,\)"):
            srv.respond(b.slots, action=[1, 2])
        with pytest.raises(shmreplay.FieldError, match="is not a distinct slot number"):
            srv.respond([b.slots[0], b.slots[0]], action=[1, 1])
        srv.respond(b.slots, action=[1])
        t.join(HANG_S)


def test_a_failed_start_unlinks_what_it_made(monkeypatch):
    made = []
    real = posix_ipc.Semaphore

    def failing(name, *args, **kw):
        if len(made) == 3:
            raise posix_ipc.Error("injected: no more semaphores")
        made.append(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(posix_ipc, "Semaphore", failing)
    before = {n for n in os.listdir("/dev/shm") if PREFIX in n}
    with pytest.raises(posix_ipc.Error, match="injected"):
        server(slots=8)
    assert len(made) == 3 and {n for n in os.listdir("/dev/shm") if PREFIX in n} == before


def test_a_server_dropped_without_close_unlinks_its_names():
    import gc
    srv = server(slots=3)
    address = srv.address
    assert len(names_of(address)) == 5
    del srv
    gc.collect()
    assert names_of(address) == set()


def test_an_env_dying_while_a_batch_fills_is_dropped_from_it():
    import threading
    with server(slots=2) as srv:
        go = FORK.Event()
        env = FORK.Process(target=env_until_told, args=(srv.address, go, 1))
        new = None
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
            new = FORK.Process(target=env_main, args=(srv.address, 3, 5))
            new.start()
            serve(srv, 5)
            new.join(HANG_S)
            assert new.exitcode == 0
        finally:
            reap([env, *([new] if new else [])])


def _signal_then_call(address: str, parent: int, signals: int) -> None:
    """Interrupt the server's sleep with signals (as SIGCHLD does in a
    learner with a DataLoader), then post one request."""
    import time
    for _ in range(signals):
        os.kill(parent, signal.SIGUSR1)
        time.sleep(0.005)
    with shmreplay.InferenceClient(address, timeout=HANG_S) as ch:
        assert int(ch.call(obs=np.ones(4, np.float32), reward=0.0, done=False)["action"]) == policy(np.ones(4))


def test_signals_that_interrupt_a_wait_do_not_end_it():
    """Found running test_torch.py first: torch's DataLoader sets a SIGCHLD
    handler, and a semaphore wait interrupted by a handled signal raised
    posix_ipc.SignalError out of receive()."""
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    try:
        with server(slots=1) as srv:
            p = FORK.Process(target=_signal_then_call, args=(srv.address, os.getpid(), 40))
            p.start()
            try:
                b = srv.receive(timeout=HANG_S)   # sleeps on the doorbell through the signals
                srv.respond(b.slots, action=policy(b.data["obs"]))
            finally:
                p.join(HANG_S)
            assert p.exitcode == 0 and len(b) == 1 and got
    finally:
        signal.signal(signal.SIGUSR1, old)
