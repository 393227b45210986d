"""Bad input: the offender gets a named error, everyone else carries on."""

import os
import signal
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

import shmreplay
from shmreplay.wire import records as C
from shmreplay.wire.layout import TableMap

from rawclient import commit, reserve, send_raw
from conftest import SMALL_FIELDS
from readback import committed
from waiting import HANG_S, wait_for, worker_context


def good_row(i=0):
    return {"obs": np.full((4, 8, 8), i % 256, np.uint8), "action": i, "reward": float(i)}


def good_batch(actions):
    a = np.asarray(actions, dtype=np.int64)
    obs = np.broadcast_to((a % 256).astype(np.uint8)[:, None, None, None], (a.shape[0], 4, 8, 8))
    return {"obs": obs.copy(), "action": a, "reward": a.astype(np.float32)}


@pytest.fixture
def table(client):
    return client.create_table("t", capacity=100, fields=SMALL_FIELDS)


def assert_still_serving(daemon, n_before=None):
    with daemon.connect() as c:
        t = c.table("t")
        if n_before is not None:
            assert len(t) == n_before
        t.insert(**good_row(7))
        t.flush()
        assert len(t.sample(4)) == 4


# ---- fields ----

def test_unknown_and_missing_fields_are_named(table):
    with pytest.raises(shmreplay.FieldError, match=r"unknown field\(s\) \['rewrd'\]"):
        table.insert(obs=np.zeros((4, 8, 8), np.uint8), action=1, rewrd=0.0)
    with pytest.raises(shmreplay.FieldError, match=r"missing field\(s\) \['reward'\]"):
        table.insert_batch({"obs": np.zeros((1, 4, 8, 8), np.uint8), "action": [1]})


def test_wrong_dtype_is_named(table):
    with pytest.raises(shmreplay.FieldError, match="field 'obs': dtype float64 cannot be stored as uint8"):
        table.insert(obs=np.zeros((4, 8, 8)), action=1, reward=0.0)
    with pytest.raises(shmreplay.FieldError, match="field 'action'"):
        table.insert(obs=np.zeros((4, 8, 8), np.uint8), action=1.5, reward=0.0)


def test_wrong_shape_is_named(table):
    with pytest.raises(shmreplay.FieldError, match=r"field 'obs': shape \(4, 8\), expected \(4, 8, 8\)"):
        table.insert(obs=np.zeros((4, 8), np.uint8), action=1, reward=0.0)
    with pytest.raises(shmreplay.FieldError, match=r"field 'obs': shape \(2, 4, 8, 9\)"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 9), np.uint8), "action": [1, 2], "reward": [0.0, 0.0]})
    with pytest.raises(shmreplay.FieldError, match="field 'action' has 3 items, earlier fields have 2"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2, 3], "reward": [0.0, 0.0]})


def test_rejected_inserts_store_nothing(daemon, table):
    with pytest.raises(shmreplay.FieldError):
        table.insert(obs=np.zeros(3), action=1, reward=0.0)
    table.flush()
    assert len(table) == 0
    assert_still_serving(daemon, 0)


# ---- priorities ----

@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_priorities_are_rejected_everywhere(daemon, table, bad):
    with pytest.raises(shmreplay.PriorityError, match=r"priority\[0\] = .* not a finite number >= 0"):
        table.insert(priority=bad, **good_row())
    with pytest.raises(shmreplay.PriorityError, match=r"priority\[1\]"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2],
                            "reward": [0.0, 0.0]}, priorities=[1.0, bad])
    table.insert(**good_row())
    b = table.sample(1)
    with pytest.raises(shmreplay.PriorityError):
        table.update_priorities(b.keys, [bad])
    table.flush()
    assert len(table) == 1
    assert_still_serving(daemon, 1)


def test_priority_count_must_match(table):
    with pytest.raises(shmreplay.PriorityError, match=r"expected 2 priorities, got shape \(3,\)"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2],
                            "reward": [0.0, 0.0]}, priorities=[1.0, 1.0, 1.0])


def test_priority_whose_power_overflows_the_tree_is_rejected(client):
    t = client.create_table("huge", capacity=10, fields=SMALL_FIELDS, alpha=2.0)
    with pytest.raises(shmreplay.PriorityError, match="exceeds the sum tree's limit"):
        t.insert(priority=1e200, **good_row())


def test_daemon_rejects_bad_priorities_that_bypass_the_client(daemon, table):
    """A client that skips validation still cannot poison the tree."""
    c = table.client
    rid, _, slots = reserve(table, 1)
    commit(table, rid, 1, prios=np.array([np.nan]))
    with pytest.raises(shmreplay.PriorityError, match="not a finite number"):
        table.flush()
    assert len(table) == 0
    assert client_stats(c)["reserved"] == 0, "the failed commit's slot was freed"
    assert_still_serving(daemon, 0)


def client_stats(c, name="t"):
    return c.stats()["tables"][name]


# ---- tables ----

def test_unknown_table_is_named(client):
    with pytest.raises(shmreplay.UnknownTable, match="no table named 'nope'"):
        client.table("nope")


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="bad name"), "invalid table name"),
    (dict(capacity=0), "capacity 0 outside"),
    (dict(fields={"o": ("object", ())}), "not a plain numeric"),
    (dict(fields={"o": ("nosuchtype", ())}), "unknown dtype"),
    (dict(fields={"o": ("uint8", (0, 3))}), "positive ints"),
    (dict(fields={"1o": ("uint8", ())}), "invalid field name"),
    (dict(fields={}), "at least one field"),
    (dict(sampler="heap"), "sampler 'heap' is not one of"),
    (dict(samples_per_insert=8.0, error_buffer=2.0), "narrower than"),
    (dict(alpha=-1), "alpha must be finite"),
])
def test_bad_table_definitions_are_named(client, kwargs, match):
    args = dict(name="ok", capacity=10, fields=SMALL_FIELDS)
    args.update(kwargs)
    with pytest.raises(shmreplay.SchemaError, match=match):
        client.create_table(**args)


def test_too_large_table_fails_at_create_with_shm_full(daemon, client):
    with pytest.raises(shmreplay.ShmFull, match="/dev/shm has .* MiB free"):
        client.create_table("giant", capacity=2**32 - 1, fields={"x": ("uint8", (4096,))})
    assert not [n for n in os.listdir("/dev/shm") if "giant" in n]
    client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert_still_serving(daemon)



@pytest.mark.parametrize("capacity, fields", [
    (10, {"a": ("int64", ()), "big": ("uint8", (2**62,))}),     # was: "internal error" from the daemon
    (10, {"a": ("int64", ()), "big": ("float32", (2**70,))}),   # was: OverflowError in the client
    (2**32 - 1, {"a": ("int64", ()), "big": ("float64", (2**20,))}),  # 2**55 bytes of rows
])
def test_sizes_no_segment_could_hold_are_schema_errors(daemon, client, capacity, fields):
    with pytest.raises(shmreplay.SchemaError, match=r"table 'huge': field 'big' .* at most 2\*\*47"):
        client.create_table("huge", capacity=capacity, fields=fields)
    assert "huge" not in client.list_tables()


def test_the_daemon_refuses_sizes_no_segment_could_hold(daemon, client):
    """A definition that skips the client's checks gets the same answer."""
    spec = {"name": "huge", "capacity": 10, "fields": [["big", "|u1", [2**62]]]}
    with pytest.raises(shmreplay.SchemaError, match="field 'big'"):
        client._request("create_table", spec=spec, exist_ok=False)
    client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert_still_serving(daemon)


def test_a_truncated_table_segment_is_a_layout_error(start_daemon):
    d = start_daemon(tables=[{"name": "t", "capacity": 100, "fields": SMALL_FIELDS}])
    with d.connect() as c:
        spec = c.table("t").spec
    d.crash()
    path = f"/dev/shm/shmreplay.{d.instance}.t.t"
    size = os.path.getsize(path)
    os.truncate(path, 0)
    with pytest.raises(shmreplay.LayoutError, match=f"is 0 bytes, expected {size}"):
        TableMap.attach(path[len("/dev/shm"):], spec)  # as a client's handle attaches it
    with pytest.raises(RuntimeError, match="is 0 bytes"):  # the next daemon will not adopt it
        d.start()
    os.unlink(path)
    os.unlink(path.replace(".t.t", ".r.t"))  # its rows segment
    d.start()  # the table starts empty, as the config says


def test_bad_sample_arguments(table):
    table.insert(**good_row())
    with pytest.raises(shmreplay.ReplayError, match="batch_size 0 outside"):
        table.sample(0)
    with pytest.raises(shmreplay.ReplayError, match="beta must be finite"):
        table.sample(1, beta=float("nan"))


# ---- the daemon ----

def test_no_daemon_is_daemon_unavailable(tmp_path):
    with pytest.raises(shmreplay.DaemonUnavailable, match="no shmreplay daemon at"):
        shmreplay.connect(str(tmp_path / "nothing.sock"))


class CountingPoll:
    """The client's doorbell poller, recording the timeout of every wait."""

    def __init__(self, inner):
        self.inner, self.waits_ms = inner, []

    def poll(self, timeout_ms):
        self.waits_ms.append(timeout_ms)
        return self.inner.poll(timeout_ms)


def test_a_crash_is_noticed_within_one_50_ms_wait(start_daemon):
    """The documented ~50 ms: a client parked in a wait (timeout None) sleeps
    on its doorbell at most 50 ms at a time and checks the control socket
    after each sleep, so once the dead daemon's socket is closed it starts
    at most one more sleep before DaemonUnavailable.  Counted in sleeps, not
    measured in seconds, so a loaded machine cannot fail it."""
    d = start_daemon()
    c = d.connect(timeout=HANG_S)
    t = c.create_table("t", capacity=10, fields=SMALL_FIELDS)
    bell = c._pipe._bell = CountingPoll(c._pipe._bell)
    seen = {}

    def crash_once_parked():
        with d.connect() as admin:
            wait_for(lambda: admin.stats()["tables"]["t"]["limiter"]["waiting_samples"] == 1,
                     "the sample to park on the empty table")
        d.kill()  # returns once the process is reaped: its socket is closed
        seen["sleeps"] = len(bell.waits_ms)

    killer = threading.Thread(target=crash_once_parked)
    killer.start()
    with pytest.raises(shmreplay.DaemonUnavailable, match="closed the connection|went away"):
        t.sample(1, timeout=None)
    killer.join(HANG_S)
    assert not killer.is_alive()
    assert bell.waits_ms and max(bell.waits_ms) <= 50, "every sleep is at most 50 ms"
    assert len(bell.waits_ms) - seen["sleeps"] <= 1, bell.waits_ms
    with pytest.raises(shmreplay.DaemonUnavailable):
        t.insert(**good_row())
    c.close()


def test_stopped_daemon_says_it_is_shutting_down(start_daemon):
    d = start_daemon()
    c = d.connect()
    t = c.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert d.stop() == 0
    with pytest.raises(shmreplay.DaemonUnavailable, match="shutting down|closed the connection"):
        t.insert(**good_row())
    c.close()


# ---- malformed control frames ----

def raw_exchange(path, payload: bytes) -> list:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(payload)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    out = []
    while len(data) >= 4:
        (n,) = struct.unpack(">I", data[:4])
        out.append(msgpack.unpackb(data[4:4 + n], raw=False))
        data = data[4 + n:]
    return out


def frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("payload, match", [
    (b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", "not valid msgpack"),
    (struct.pack(">I", 50 << 20), "frame length"),
    (struct.pack(">I", 0), "frame length 0"),
    (frame([1, 2, 3]), "expected a map"),
    (frame({"op": "stats", "id": 1}), "first request must be 'hello'"),
    (frame({"op": "hello", "id": 1, "protocol": 99, "pid": 1}), "protocol 99"),
    (frame({"op": "hello", "id": 1, "protocol": 1, "pid": "me"}), "'pid' must be int"),
    (frame({"op": "fly", "id": 1}), "unknown op"),
    (frame({"op": "hello"}), "integer 'id'"),
])
def test_malformed_frames_close_only_that_connection(daemon, client, payload, match):
    t = client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    t.insert(**good_row())  # an innocent client, connected throughout
    msgs = raw_exchange(daemon.socket, payload)
    assert msgs and msgs[-1]["op"] == "bye" and msgs[-1]["error"] == "ProtocolError"
    assert match in msgs[-1]["message"]
    t.insert(**good_row(1))
    t.flush()
    assert len(t) == 2
    assert "closing it" in daemon.log()


# ---- records with out-of-range values (fault/test_fuzz.py fuzzes the rings) ----

def assert_rows_ok(data):
    np.testing.assert_array_equal(data["obs"][:, 0, 0, 0], (data["action"] % 256).astype(np.uint8))


def test_out_of_range_keys_in_update_disconnect_the_sender(daemon, client):
    t = client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    t.insert(**good_row())
    bad = daemon.connect()
    bt = bad.table("t")
    send_raw(bad, C.UPDATE, bt.id, a0=1, payload=(np.array([99], np.uint64), np.array([1.0])))
    with pytest.raises(shmreplay.ProtocolError, match="beyond capacity"):
        bt.sample(1)
    bad.close()
    assert_still_serving(daemon, 1)


def test_committing_someone_elses_reservation_is_refused(daemon, client):
    t = client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    rid, _, _ = reserve(t, 2)
    thief = daemon.connect()
    tt = thief.table("t")
    commit(tt, rid, 2)
    with pytest.raises(shmreplay.ProtocolError, match="not yours"):
        thief.flush()
    thief.close()
    commit(t, rid, 2)
    client.flush()
    assert len(t) == 2


# ---- a client killed mid-write ----

POISON = 0xEE


def die_mid_write(sock, ready):
    c = shmreplay.connect(sock)
    t = c.table("t")
    rid, _, slots = reserve(t, 8)
    t._views["obs"][slots[:5]] = POISON  # a partial copy, then the process dies
    ready.set()
    time.sleep(60)


def test_client_killed_mid_write_loses_nothing_of_others(daemon, client):
    t = client.create_table("t", capacity=40, fields=SMALL_FIELDS, sampler="uniform")
    t.insert_batch(good_batch(range(20)))
    t.flush()
    ctx = worker_context()
    ready = ctx.Event()
    proc = ctx.Process(target=die_mid_write, args=(daemon.socket, ready))
    proc.start()
    assert ready.wait(60)
    assert client_stats(client)["reserved"] == 8
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    wait_for(lambda: client_stats(client)["reserved"] == 0, "the dead writer's reservation to be reclaimed")
    st = client_stats(client)
    assert st["reclaimed_reservations"] == 8 and st["size"] == 20
    got, _ = committed(t)  # the 20 items, each whole; none of the half-written rows
    np.testing.assert_array_equal(got["action"], np.arange(20))
    assert_rows_ok(got)
    for _ in range(50):
        b = t.sample(64)
        assert not np.any(b.data["obs"] == POISON), "a half-written row was sampled"
        assert_rows_ok(b.data)
    # the reclaimed slots are reused
    t.insert_batch(good_batch(range(20, 40)))
    t.flush()
    assert len(t) == 40


def test_scribbled_control_words_disconnect_only_the_offender(start_daemon):
    from shmreplay.wire import atomics
    from shmreplay.wire.channel import CTL_REQ_HEAD, CTL_RESP_TAIL
    # a 1 s spin makes the scribble land while the engine spins re-reading heads
    daemon = start_daemon(spin_us=1_000_000)
    client = daemon.connect()
    t = client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    for word in (CTL_REQ_HEAD, CTL_RESP_TAIL):
        bad = daemon.connect(timeout=10)
        bt = bad.table("t")
        atomics.store(bad._pipe.chan.ctl, word, np.uint64(2**63 + 12345))
        os.eventfd_write(bad._pipe.to_daemon, 1)
        def told():  # the offender learns it from its next waits
            try:
                bad._link.live()
                if len(t):
                    bt.sample(1)
            except shmreplay.ProtocolError as exc:
                return exc
            return None
        exc = wait_for(told, "the daemon to disconnect the offender")
        assert "impossible position" in str(exc), exc
        bad.close()
        t.insert(**good_row(len(t)))
        t.flush()
    assert len(t) == 2 and daemon.proc.poll() is None
    client.close()
