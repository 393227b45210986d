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
