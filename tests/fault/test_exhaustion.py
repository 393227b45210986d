"""Promise 6: running out of something is a clear error for whoever asked,
and nobody else's problem: /dev/shm, the client and table limits, and a
client that stops reading its replies."""

import os
import socket
import threading

import numpy as np
import pytest

import shmreplay
from shmreplay.server.control.handshake import CHANNEL
from shmreplay.server.engine.outbox import MAX_OUTBOX
from shmreplay.wire import records as C

from faults import FIELDS, HANG_S, rows, torn, wait_for
from rawclient import send_raw


def test_client_and_table_limits_from_the_config(start_daemon):
    d = start_daemon(max_clients=3, max_tables=2)
    clients = [d.connect() for _ in range(3)]
    with pytest.raises(shmreplay.CapacityError, match="max_clients 3"):
        d.connect()
    t = clients[0].create_table("a", capacity=8, fields=FIELDS)
    clients[1].create_table("b", capacity=8, fields=FIELDS)
    with pytest.raises(shmreplay.CapacityError, match="max_tables 2"):
        clients[2].create_table("c", capacity=8, fields=FIELDS)
    t.insert(**{k: v[0] for k, v in rows([1]).items()})  # the others carry on
    clients[0].flush()
    clients.pop().close()
    # close() ends the lease on this side; the place is free once the daemon
    # has seen the connection go and ended the lease on its side
    wait_for(lambda: (st := clients[0].stats())["connections"] == 2 and st["clients"] == 2,
             "the daemon to end the closed client's lease")
    with d.connect() as late:  # a freed place is usable again
        assert len(late.table("a")) == 1
    for c in clients:
        c.close()


def test_one_user_and_a_silent_connection_cannot_take_every_place(start_daemon):
    """Issue 12 item 10: a per-user connection limit, and a handshake
    timeout for connections that never say hello."""
    d = start_daemon(max_clients=8, max_clients_per_user=2, handshake_timeout_s=5.0)
    a, b = d.connect(), d.connect()
    with pytest.raises(shmreplay.CapacityError, match="max_clients_per_user 2"):
        d.connect()
    a.close()
    wait_for(lambda: b.stats()["connections"] == 1, "the daemon to end the closed client's lease")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.settimeout(HANG_S)  # a hang guard; the daemon closes it after handshake_timeout_s
    silent.connect(d.socket)
    said = b""
    while chunk := silent.recv(65536):
        said += chunk
    silent.close()
    assert b"no hello and ready within 5 s" in said  # its bye notice says why
    wait_for(lambda: b.stats()["connections"] == 1, "the silent connection's place to be freed")
    with d.connect() as c:  # the places are usable again
        assert c.stats()["connections"] == 2
    b.close()


def test_a_table_the_machine_cannot_hold_is_refused_before_anything_is_made(start_daemon):
    """Issue 12 item 10: the daemon's own arrays count too (a prioritized
    table's trees are larger than its metadata)."""
    from shmreplay.server.control.memory import mem_available
    from shmreplay.wire.segment import shm_free_bytes
    avail, shm = mem_available(), shm_free_bytes()
    # shared memory 46 B a slot, the daemon's arrays 56 B: pick a size whose
    # segments fit /dev/shm but whose total does not fit the memory
    cap = 1 << max(1, int(avail / 102 * 1.2)).bit_length()
    if not (46 * cap < shm and 102 * cap > avail):
        pytest.skip("no table size separates /dev/shm space from memory on this machine")
    d = start_daemon()
    with d.connect() as c:
        with pytest.raises(shmreplay.CapacityError, match=r"in the daemon\) but only"):
            c.create_table("huge", capacity=cap, fields={"x": ("uint8", ())})
        assert c.list_tables() == []
        assert not [n for n in os.listdir("/dev/shm") if f"{d.instance}." in n and "huge" in n]


def test_a_client_that_never_reads_its_replies_stalls_nobody(start_daemon):
    d = start_daemon()
    good = d.connect()
    t = good.create_table("t", capacity=256, fields=FIELDS, sampler="uniform")
    t.insert_batch(rows(np.arange(256)))
    good.flush()
    bad = d.connect(timeout=HANG_S)
    bt = bad.table("t")
    sent = {"n": 0}

    def send_sample():  # a SAMPLE whose reply is never read
        send_raw(bad, C.SAMPLE, bt.id, a0=64, a1=0, f0=0.4)
        sent["n"] += 1

    # first a backlog the daemon holds for the bad client, short of the
    # cut-off: its reply ring full and more replies queued behind it
    backlog = CHANNEL.resp_slots + MAX_OUTBOX // 2
    commands = good.stats()["engine"]["commands"]
    for _ in range(backlog):
        send_sample()
    wait_for(lambda: good.stats()["engine"]["commands"] >= commands + backlog,
             "the daemon to run the bad client's SAMPLEs")
    samples = 0
    for _ in range(50):  # the honest learner is served meanwhile
        assert torn(t.sample(32).data) == 0
        samples += 1

    def flood():  # then SAMPLE after SAMPLE until the daemon cuts it off
        try:
            for _ in range(20_000):
                send_sample()
        except shmreplay.ReplayError as exc:
            sent["error"] = exc

    th = threading.Thread(target=flood, daemon=True)
    th.start()
    while th.is_alive() and samples < 2000:
        assert torn(t.sample(32).data) == 0  # the honest learner keeps being served
        samples += 1
    th.join(HANG_S)
    assert not th.is_alive()
    assert isinstance(sent.get("error"), shmreplay.ProtocolError), sent
    assert "responses unread" in str(sent["error"])
    assert sent["n"] > backlog
    wait_for(lambda: "responses unread; disconnecting it" in d.log(), "the cut-off to be logged")
    assert len(t.sample(8)) == 8
    bad._session.abandon()
    good.close()


def test_full_dev_shm_fails_create_and_attach_clearly_and_harms_no_one(tmp_path):
    """A real full /dev/shm: a 48 MiB tmpfs in a private mount namespace,
    inside a user namespace (unshare -rm), so it needs no root."""
    import json
    import shutil
    import subprocess
    import sys
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small /dev/shm privately")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    unshare = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    script = (f"mount -t tmpfs -o size=48m tmpfs /dev/shm && "
              f"exec {sys.executable} {os.path.join(here, 'shm_full_scenario.py')}")
    probe = subprocess.run([*unshare, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.decode().strip()}")
    # root inside the namespace is this user outside: the daemon's lock goes
    # in a runtime directory this user owns, not /run/shmreplay
    run = subprocess.run([*unshare, "sh", "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=root, RUNTIME_DIRECTORY=str(tmp_path)))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "/dev/shm has" in out["create"] and "MiB free but segment" in out["create"]
    assert out["attach"] is True
    assert out["still_serving"] and out["recovered"]
    assert out["daemon_exit"] == 0 and out["left"] == []


