"""What the inference channel's tests share (test_inference.py,
test_inference_failures.py, fault/test_inference_*.py): the channel they
serve, a policy whose answer is a function of each env's own observation,
env process bodies (and one served to its end: ``serve_env``), and the raw
control words as any process of the user can map them."""

from __future__ import annotations

import mmap
import multiprocessing
import os

import numpy as np

import shmreplay
from shmreplay.inference import layout as wi
from shmreplay.wire import atomics
from waiting import HANG_S, reap

PREFIX = f"shmreplay.test{os.getpid()}.inf"
REQUEST = {"obs": ("float32", (4,)), "reward": ("float32", ()), "done": ("bool", ())}
RESPONSE = {"action": ("int64", ())}
FORK = multiprocessing.get_context("fork")



def server(slots=4, **kw) -> shmreplay.InferenceServer:
    return shmreplay.InferenceServer(REQUEST, RESPONSE, slots=slots, prefix=PREFIX, **kw)


def reachable(address: str) -> bool:
    """Does the address's descriptor still name a memfd (the server has not
    closed, sealed or lost it)?  The kernel's own link, read as any process
    of the user can."""
    try:
        return os.readlink(address.split("#")[0]).startswith("/memfd:")
    except FileNotFoundError:
        return False


def shm_names(*marks: str) -> set[str]:
    """The /dev/shm entries whose names hold any of ``marks`` (this run's
    PREFIX, a channel's token): a channel makes none."""
    return {n for n in os.listdir("/dev/shm") if any(m in n for m in marks)}


def token_of(address: str) -> str:
    return address.split("#")[1]


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


def serve_env(srv, env_id: int, steps: int) -> None:
    """One forked env process (``env_main``) served to its end; it must exit 0."""
    env = FORK.Process(target=env_main, args=(srv.address, env_id, steps))
    try:
        env.start()
        serve(srv, steps)
        env.join(HANG_S)
        assert env.exitcode == 0
    finally:
        reap([env])


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


def raw_segment(address: str) -> mmap.mmap:
    """The whole channel, mapped as any process of the user can: through
    the server's descriptor, with no check."""
    fd = os.open(address.split("#")[0], os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def raw_views(address: str):
    """(header and control words, control words) of the channel, mapped as
    any process of the user can."""
    buf = raw_segment(address)
    lay, _, _ = wi.read_layout(buf, address)
    return wi.views(buf, lay)[:2]


def raw_ctrl(address: str) -> np.ndarray:
    """The channel's control words."""
    return raw_views(address)[1]


def raw_header(address: str) -> np.ndarray:
    """The channel's header words (and the control lines after them)."""
    return raw_views(address)[0]


def state(ctrl, slot: int) -> tuple[int, int]:
    w = int(atomics.load(ctrl, slot * wi.SLOT_WORDS))
    return w >> 8, w & 0xFF
