"""shmreplay.Server: a private daemon that a program starts and stops itself."""

import itertools
import multiprocessing
import os

import numpy as np
import pytest

import shmreplay
from conftest import shm_entries

_n = itertools.count()
FIELDS = {"obs": ("float32", (4,)), "action": ("int64", ())}


def instance() -> str:
    return f"test{os.getpid()}srv{next(_n)}"   # the suite's leak check sees its objects


def _child_inserts(client, k):
    t = client.table("replay")
    t.insert_batch({"obs": np.full((k, 4), 2.0), "action": np.arange(k)})
    client.close()


def test_server_serves_its_tables_to_this_process_and_children_and_leaves_nothing():
    name = instance()
    with shmreplay.Server(tables=[dict(name="replay", capacity=1000, fields=FIELDS),
                                  ("queue", dict(name="q", capacity=16, fields=FIELDS))],
                          instance=name) as server:
        client = server.connect()
        assert sorted(client.list_tables()) == ["q", "replay"]
        assert shm_entries(f"shmreplay.{name}.")
        ctx = multiprocessing.get_context("spawn")
        p = ctx.Process(target=_child_inserts, args=(client, 5))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        t = client.table("replay")
        client.flush()
        assert len(t) == 5
        b = t.sample(3)
        assert (b.data["obs"] == 2.0).all()
        socket_dir = server.dir
    assert not shm_entries(f"shmreplay.{name}.")
    assert not os.path.exists(socket_dir)
    with pytest.raises(shmreplay.DaemonUnavailable, match="stopped"):
        server.connect()


def test_server_that_fails_to_start_raises_with_its_log():
    with pytest.raises(shmreplay.ServerFailed, match=r"(?s)exited with code \d.*max_clients"):
        shmreplay.Server(instance=instance(), max_clients="many")


def test_server_refuses_a_bad_table_and_stops_its_daemon():
    name = instance()
    with pytest.raises(shmreplay.SchemaError):
        shmreplay.Server(tables=[dict(name="bad", capacity=10, fields={"x": ("float99", ())})],
                         instance=name)
    assert not shm_entries(f"shmreplay.{name}.")


def test_a_server_under_a_tmpdir_too_long_for_a_socket_path_still_starts(tmp_path, monkeypatch):
    """``Server`` keeps its socket in a private temporary directory; under a
    $TMPDIR so long that no Unix socket path fits (108 bytes), it takes one
    under /tmp instead of failing with the daemon's "AF_UNIX path too long"."""
    import tempfile
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads $TMPDIR again
    with shmreplay.Server(instance=f"test{os.getpid()}longtmp") as srv:
        assert srv.socket.startswith("/tmp/shmreplay-server-") and len(srv.socket) <= 107
        with srv.connect() as c:
            t = c.create_table("t", capacity=8, fields={"x": ("int64", ())})
            t.insert(x=np.int64(1))
            c.flush()
            assert len(t) == 1
    assert not os.path.exists(srv.dir)


def test_a_config_file_keeps_the_keys_it_sets_and_the_rest_are_private(tmp_path):
    """``config=``: its [daemon] keys and [[tables]] (nested fields) are the
    daemon's; what it leaves out of access (segment_mode, group) is the
    Server's private default: mode 0600 socket and segments (issue 34,
    item 4).  A segment_mode it sets is kept."""
    import stat
    from daemons import write_config
    table = {"name": "cfg", "capacity": 8, "fields": {"x": ("int64", ()), "o": ("float32", (3,))}}
    for extra, mode in (({}, 0o600), ({"segment_mode": "0640"}, 0o640)):
        path = write_config(tmp_path / f"c{mode:o}.toml", [table], hold_timeout_s=7.0, **extra)
        name = instance()
        with shmreplay.Server(config=path, instance=name) as srv, srv.connect() as c:
            assert c.list_tables() == ["cfg"]
            rows = [n for n in shm_entries(f"shmreplay.{name}.r.cfg.")]
            got = {stat.S_IMODE(os.stat(p).st_mode) for p in [srv.socket, *(f"/dev/shm/{n}" for n in rows)]}
            assert len(rows) == 1 and got == {mode}, (rows, got)

