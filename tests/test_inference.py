"""The inference channel (SEED-style serving, no daemon), serving: real env
processes (forked and spawned) and a server in this process or a child.

No assertion depends on timing: each test arranges the state it checks
(an env blocked in its call, a request taken and not answered, a process
killed) and waits for it with a hang guard (``waiting.wait_for``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

import shmreplay
from inferencekit import (FORK, PREFIX, REQUEST, RESPONSE, env_main, env_until_told, policy, reachable, serve,
                          serve_env, server, shm_names, token_of)
from waiting import HANG_S, reap


def test_many_envs_forked_and_spawned_each_get_their_own_answers():
    with server(slots=6) as srv:
        assert reachable(srv.address)
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
    assert not reachable(srv.address)


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


def test_seal_closes_the_descriptor_and_attached_envs_go_on():
    with server(slots=2) as srv:
        go = FORK.Event()
        envs = [FORK.Process(target=env_until_told, args=(srv.address, go, 30)) for _ in range(2)]
        try:
            for p in envs:
                p.start()
            srv.wait_attached(2, timeout=HANG_S)
            srv.seal()
            assert not reachable(srv.address) and srv.stats()["sealed"]
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


def test_a_failed_start_closes_what_it_made(monkeypatch):
    """A start that fails once its memfd exists (here: writing the header)
    leaves no descriptor open, and nothing in /dev/shm."""
    from shmreplay.inference import layout as wi

    def failing(*args):
        raise OSError("injected: the header write failed")

    monkeypatch.setattr(wi, "write_header", failing)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="injected"):
        server(slots=8)
    assert set(os.listdir("/proc/self/fd")) <= fds and shm_names(PREFIX) == set()


def test_a_server_dropped_without_close_closes_its_descriptor():
    import gc
    srv = server(slots=3)
    address = srv.address
    assert reachable(address)
    del srv
    gc.collect()
    assert not reachable(address)


def test_a_channel_has_no_name_in_dev_shm():
    """"The channel then has no name in /dev/shm at all": while a server
    serves an env, no /dev/shm entry holds its label or its token, and the
    object its address names lives on another filesystem than /dev/shm
    (the kernel's internal one for memfds)."""
    with server(slots=2) as srv:
        serve_env(srv, 1, 5)
        assert shm_names(PREFIX, token_of(srv.address)) == set()
        target = os.stat(srv.address.split("#")[0])
        assert target.st_dev != os.stat("/dev/shm").st_dev, "the channel is a /dev/shm file"
        assert os.readlink(srv.address.split("#")[0]) == f"/memfd:{PREFIX} (deleted)"


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
    posix_ipc.SignalError out of receive() (the doorbell is a futex word
    now: an interrupted wait is one more look)."""
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
