"""Issue 12, item 1: no exception in serving one request kills the engine,
and an engine that dies anyway keeps every table for the next daemon,
exactly as a SIGKILL would; only a requested clean stop removes tables.

The first test writes daemon-owned metadata as root (only the daemon's own
user or root can: see test_hostile_clients.py for a group member, who
cannot); the second injects a failure into a real daemon's engine thread
(``crashing_daemon.py``)."""

import os
import sys
import threading

import numpy as np

import shmreplay
from faults import FIELDS, HANG_S, committed_ids, rows, wait_for, writable_map

HERE = os.path.dirname(os.path.abspath(__file__))
VICTIM = {"name": "victim", "capacity": 4096, "sampler": "prioritized", "fields": FIELDS}
ORDERED = {"name": "ordered", "capacity": 64, "sampler": "fifo", "remover": "fifo",
           "max_times_sampled": 3, "min_size_to_sample": 2, "fields": FIELDS}


def test_a_request_that_breaks_the_engine_cuts_off_only_its_client(start_daemon):
    d = start_daemon(tables=[VICTIM, ORDERED])
    with d.connect() as owner:
        owner.table("victim").insert_batch(rows(np.arange(3000)))
        owner.flush()
        with d.connect() as c:
            t = c.table("ordered")
            t.insert(**{k: v[0] for k, v in rows([1]).items()})
            c.flush()
            writable_map(d.segment("ordered")).times[:] = 0xFFFFFFF0  # more uses than max_times_sampled allows
            got = []

            def learn():
                with d.connect() as learner:
                    try:  # parks: one item, min size 2
                        got.append(learner.table("ordered").sample(2, timeout=HANG_S))
                    except shmreplay.ReplayError as exc:
                        got.append(exc)

            th = threading.Thread(target=learn, daemon=True)
            th.start()
            wait_for(lambda: owner.stats()["tables"]["ordered"]["limiter"]["waiting_samples"] == 1,
                     "the sample to park")
            t.insert(**{k: v[0] for k, v in rows([2]).items()})
            c.flush()  # the parked sample now runs into the damaged counts
            th.join(HANG_S)
            # cut off, and told why: not an error reply as if the sample were refused
            assert len(got) == 1 and isinstance(got[0], shmreplay.ProtocolError), got
            assert "daemon could not apply a command" in str(got[0]), got
            log = d.log()
            assert "parked request failed" in log and log.count("disconnecting it") == 1, log[-2000:]
            # only that client: the other one on the same table still inserts
            t.insert(**{k: v[0] for k, v in rows([3]).items()})
            c.flush()
            assert owner.stats()["clients"] == 2
        # the daemon still serves, and the other table lost nothing
        assert d.proc.poll() is None
        v = owner.table("victim")
        assert len(v) == 3000
        v.insert_batch(rows(np.arange(3000, 3010)))
        owner.flush()
        assert len(v) == 3010


def test_an_engine_failure_keeps_every_table_for_the_next_daemon(start_daemon, tmp_path):
    crash = tmp_path / "crash-now"
    d = start_daemon(tables=[VICTIM], command=[sys.executable, os.path.join(HERE, "crashing_daemon.py")],
                     env={"SHMREPLAY_TEST_CRASH_FILE": str(crash)})
    with d.connect() as c:
        c.table("victim").insert_batch(rows(np.arange(3000)))
        c.flush()
    crash.touch()
    code = d.proc.wait(HANG_S)
    assert code == 1, f"an engine failure exits 1 (documented), not {code}: never a clean stop"
    segment = d.segment("victim")
    assert committed_ids(segment).tolist() == list(range(3000))
    crash.unlink()
    d.start()
    with d.connect() as c:
        t = c.table("victim")
        assert len(t) == 3000
        b = t.sample(256)
        assert np.all(b.data["obs"][:, 0] == b.data["id"] % 251)
