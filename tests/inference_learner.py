"""A learner program for tests/test_inference_processes.py: an
InferenceServer in a process of its own, so that what the end of a process
does (atexit, the finalizers) really happens.  Each report is one JSON line
on stdout; each pause waits for a line on stdin.

    python inference_learner.py fork <prefix>
        a channel with an env of its own (slot 0); a forked child tries the
        inherited server and client, closes them (nothing of the parent's),
        attaches its own client, makes one call and exits normally (atexit
        and the finalizers run in the child); report, pause; a call on the
        parent's own client; close everything; report; pause; exit.
    python inference_learner.py exit <prefix>
        a channel; report its address; pause; exit without close().
"""

from __future__ import annotations

import json
import os
import sys
import threading

import shmreplay
from inferencekit import REQUEST, RESPONSE, policy
from waiting import HANG_S

KEPT = []  # the exit mode's server: held until the interpreter's exit, not collected before


def say(**out) -> None:
    print(json.dumps(out), flush=True)


def tried(use) -> str:
    try:
        use()
    except shmreplay.ReplayError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def forked_child(srv, mine, w: int) -> None:
    out = {"pid": os.getpid(),
           "client call": tried(lambda: mine.call(obs=[1, 0, 0, 0], reward=0, done=False)),
           "server receive": tried(lambda: srv.receive(timeout=0)),
           "server seal": tried(srv.seal)}
    mine.close()
    srv.close()
    with shmreplay.InferenceClient(srv.address, timeout=HANG_S) as ch:
        out["slot"] = ch.slot
        out["answer"] = int(ch.call(obs=[7, 8, 0, 0], reward=0, done=False)["action"])
    with os.fdopen(w, "w") as f:
        json.dump(out, f)
    sys.exit(0)


def fork(prefix: str) -> None:
    srv = shmreplay.InferenceServer(REQUEST, RESPONSE, slots=2, prefix=prefix)
    mine = shmreplay.InferenceClient(srv.address, timeout=HANG_S)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        forked_child(srv, mine, w)
    os.close(w)
    b = srv.receive(timeout=HANG_S)  # the child's own client's call
    srv.respond(b.slots, action=policy(b.data["obs"]))
    with os.fdopen(r) as f:
        out = json.load(f)
    _, status = os.waitpid(child, 0)
    say(address=srv.address, child=out, child_status=status, served=b.slots.tolist())
    sys.stdin.readline()
    got = {}
    t = threading.Thread(target=lambda: got.update(mine.call(obs=[3, 4, 0, 0], reward=0, done=False)))
    t.start()
    b = srv.receive(timeout=HANG_S)
    srv.respond(b.slots, action=policy(b.data["obs"]))
    t.join(HANG_S)
    slot = mine.slot
    mine.close()
    srv.close()
    say(slot=slot, served=b.slots.tolist(), answer=int(got["action"]))  # once closed
    sys.stdin.readline()


def exit_unclosed(prefix: str) -> None:
    KEPT.append(shmreplay.InferenceServer(REQUEST, RESPONSE, slots=2, prefix=prefix))
    say(address=KEPT[0].address)
    sys.stdin.readline()


if __name__ == "__main__":
    {"fork": fork, "exit": exit_unclosed}[sys.argv[1]](sys.argv[2])
