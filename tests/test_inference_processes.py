"""Issue 33: the inference channel across the lives of its processes: a
forked child, a server that hangs, and what a server leaves (nothing)
when it closes, exits or is killed (docs/protocol.md, "Inference channel":
"Leaving", "Who may call what", "Failure semantics").

Every server here is a real process (tests/inference_learner.py where a
process's own exit is what is checked), and what is left is read from
/proc and /dev/shm themselves, never from the channel's books.  No assertion depends on
timing: a hang guard on each wait.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import shmreplay
from inferencekit import FORK, PREFIX, raw_ctrl, reachable, server, shm_names, state, token_of
from waiting import HANG_S, all_threads_stopped, reap, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
OBS = {"obs": [1, 2, 0, 0], "reward": 0.0, "done": False}


def learner(mode: str) -> subprocess.Popen:
    """tests/inference_learner.py ``mode``; its names start ``<PREFIX>.<mode>.``."""
    return subprocess.Popen([sys.executable, os.path.join(HERE, "inference_learner.py"), mode,
                             f"{PREFIX}.{mode}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report(p: subprocess.Popen) -> dict:
    """The learner's next JSON line; a hang guard on the wait for it."""
    got = []
    t = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(HANG_S)
    assert got, f"the learner said nothing in {HANG_S} s"
    assert got[0], f"the learner ended (exit {p.wait(HANG_S)}): {p.stderr.read()}"
    return json.loads(got[0])


def go_on(p: subprocess.Popen) -> None:
    p.stdin.write("\n")
    p.stdin.flush()


def end(p: subprocess.Popen) -> None:
    """After a failed assert: the learner killed (a channel leaves nothing else)."""
    if p.poll() is None:
        p.kill()
    p.wait(HANG_S)
    for f in (p.stdin, p.stdout, p.stderr):
        f.close()


def test_a_forked_child_attaches_its_own_and_its_exit_leaves_the_parents_channel():
    """"The InferenceServer belongs to the process that made it ... In any
    other process (a forked child) they raise, and nothing it does there
    closes or unlinks the parent's channel"; "An InferenceClient belongs to
    the process that attached it; a forked child attaches its own"; a server
    left at interpreter exit is closed then, "never in a forked child".
    The child (os.fork, then a normal exit: atexit and the finalizers run)
    uses the inherited handles, closes them, attaches its own client and
    is served; afterwards every name of the parent's is still there and
    the parent's own client is served in its own slot."""
    p = learner("fork")
    try:
        first = report(p)
        address, child = first["address"], first["child"]["pid"]
        belongs = (f"belongs to process {p.pid}, not {child}: a forked child attaches its own, "
                   "InferenceClient(address)")
        assert first == {
            "address": address, "child_status": 0, "served": [1],  # the child's own client: slot 1
            "child": {"pid": child,
                      "client call": f"ReplayError: this InferenceClient {belongs}",
                      "server receive": f"ReplayError: this InferenceServer {belongs}",
                      "server seal": f"ReplayError: this InferenceServer {belongs}",
                      "slot": 1, "answer": 7 * 100_000 + 8}}  # inferencekit.policy: obs[0] * 1e5 + obs[1]
        assert reachable(address)  # the child's exit closed nothing of the parent's
        go_on(p)
        assert report(p) == {"slot": 0, "served": [0], "answer": 3 * 100_000 + 4}
        assert not reachable(address)  # close() closed its descriptor
        go_on(p)
        assert p.wait(HANG_S) == 0, p.stderr.read()
    finally:
        end(p)


def test_a_server_left_open_at_interpreter_exit_is_closed_then():
    """"A server object collected or left at interpreter exit without
    close() is closed then": its descriptor is closed (the process is
    gone, and nothing was ever in /dev/shm), and an env
    attached across the exit is told the channel closed (not that its
    learner died: the server marked it closed on its way out)."""
    p = learner("exit")
    try:
        address = report(p)["address"]
        with shmreplay.InferenceClient(address, timeout=HANG_S) as ch:
            assert reachable(address)
            go_on(p)
            assert p.wait(HANG_S) == 0, p.stderr.read()
            assert not reachable(address) and shm_names(PREFIX, token_of(address)) == set()
            with pytest.raises(shmreplay.InferenceClosed,
                               match=rf"^the InferenceServer closed inference channel {re.escape(address)}$"):
                ch.call(**OBS)
        with pytest.raises(shmreplay.InferenceClosed, match=rf"^no inference channel at {re.escape(address)}: "):
            shmreplay.InferenceClient(address)
    finally:
        end(p)


def hung_learner(conn) -> None:
    """A learner that takes one request and never answers it."""
    with server(slots=1) as srv:
        conn.send(srv.address)
        while not len(srv.receive(timeout=HANG_S)):
            pass
        conn.send("taken")
        conn.poll(HANG_S * 10)  # stopped meanwhile, then told to end


def call_in_thread(ch, **values):
    """What ``ch.call(**values)`` returned or raised; a hang guard on it."""
    got = []

    def run():
        try:
            got.append(ch.call(**values))
        except BaseException as exc:
            got.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    assert got, f"call() still waiting after {HANG_S} s"
    return got[0]


def test_a_hung_server_gets_a_replaytimeout_and_the_env_closes_cleanly():
    """"The server hangs or is stopped: ReplayTimeout after timeout": a
    SIGSTOPped server takes nothing (the request is withdrawn), a server
    that took the request and never answers gets the other message the
    failure table gives; then ``close()`` returns, frees the slot (its
    state word reads FREE) and a new env can take it."""
    mine, theirs = FORK.Pipe()
    learner_ = FORK.Process(target=hung_learner, args=(theirs,))
    address = ch = None
    try:
        learner_.start()
        assert mine.poll(HANG_S)
        address = mine.recv()
        ch = shmreplay.InferenceClient(address, timeout=1.0)
        os.kill(learner_.pid, signal.SIGSTOP)
        wait_for(lambda: all_threads_stopped(learner_.pid), "the learner stopped")
        err = call_in_thread(ch, **OBS)
        assert isinstance(err, shmreplay.ReplayTimeout) and str(err) == (
            "no reply within 1.0 s; the request was withdrawn (the server had not taken it)"), err
        os.kill(learner_.pid, signal.SIGCONT)
        # whether the running learner takes the next request before the
        # env's timeout is a race on a loaded machine: try until it does
        # (a withdrawn request leaves nothing behind)
        for _ in range(50):
            err = call_in_thread(ch, **OBS)
            assert isinstance(err, shmreplay.ReplayTimeout), err
            if "withdrawn" not in str(err):
                break
        assert str(err) == ("no reply within 1.0 s: the server took the request and has not answered; "
                            "the next call first waits for that reply and drops it")
        assert mine.poll(HANG_S) and mine.recv() == "taken"
        os.kill(learner_.pid, signal.SIGSTOP)  # and it hangs for good
        ch.close()
        assert state(raw_ctrl(address), 0) == (0, 0)
        with shmreplay.InferenceClient(address) as again:  # the only slot
            assert again.slot == 0
        os.kill(learner_.pid, signal.SIGCONT)
        mine.send("end")
        learner_.join(HANG_S)
        assert learner_.exitcode == 0
        assert not reachable(address)
    finally:
        if ch is not None:
            ch.close()
        if learner_.pid is not None and learner_.exitcode is None:  # not yet reaped: still ours
            os.kill(learner_.pid, signal.SIGCONT)
        reap([learner_])
