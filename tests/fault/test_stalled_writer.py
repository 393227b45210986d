"""Issue 12, item 7: a writer stalled between its epoch check and its copy
(here SIGSTOPped) across a daemon restart.  Its slot is reused only once it
provably cannot write it: while it is stopped, no other writer gets the
slot however often the table wraps; when it resumes, its late copy lands in
a slot no item lives in, its flush says the insert may be lost, and its
reconnect frees the slot.  No committed row is ever damaged."""

import multiprocessing as mp
import os
import signal

import numpy as np

import shmreplay

from faults import FIELDS, HANG_S, committed_ids, reap, rows, torn, wait_for

CAPACITY = 32
TABLE = {"name": "t", "capacity": CAPACITY, "sampler": "uniform", "fields": FIELDS}
POISON = -777


def stalled_writer(sock, out):
    c = shmreplay.connect(sock, timeout=HANG_S, reconnect=True, reconnect_timeout=HANG_S)
    t = c.table("t")
    lease = t._lease
    rid, pos, slot = lease.take(None)  # the epoch check has passed: the slot is ours
    out.send(("took", slot))  # synchronous: a Queue's feeder thread would stop with us
    os.kill(os.getpid(), signal.SIGSTOP)  # ... and here the writer stalls, mid-insert
    row = rows([POISON])
    for name, view in t._views.items():  # the late copy, as SlotLease.write makes it
        view[slot] = row[name][0]
    lease.commit(rid, pos, None)
    try:
        c.flush()
        out.send(("flushed", None))
    except shmreplay.DaemonUnavailable as exc:
        out.send(("lost", str(exc)))
    c.close()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_writer_stalled_mid_copy_across_a_restart_damages_nothing(start_daemon):
    d = start_daemon(tables=[TABLE])
    with d.connect() as c:
        c.table("t").insert_batch(rows(np.arange(CAPACITY)))
        c.flush()
    ctx = mp.get_context("fork")
    out, into = ctx.Pipe(duplex=False)
    w = ctx.Process(target=stalled_writer, args=(d.socket, into), daemon=True)
    w.start()
    try:
        assert out.poll(HANG_S), "the writer never took a slot"
        kind, slot = out.recv()
        assert kind == "took"
        wait_for(lambda: stopped(w.pid), "the writer to stop mid-insert")
        d.crash()
        d.start()
        with d.connect() as c:
            t = c.table("t")
            assert c.stats()["tables"]["t"]["orphaned"] == 1
            assert c.stats()["tables"]["t"]["orphan_holders"] == [{"pid": w.pid, "slots": 1}]
            for k in range(4):  # the table wraps four times; the stalled slot is never given out
                t.insert_batch(rows(np.arange(1000 + k * CAPACITY, 1000 + (k + 1) * CAPACITY)))
                c.flush()
            st = c.stats()["tables"]["t"]
            assert st["orphaned"] == 1 and st["size"] == CAPACITY - 1
            os.kill(w.pid, signal.SIGCONT)
            assert out.poll(HANG_S), "the writer never finished its insert"
            kind, msg = out.recv()
            assert kind == "lost" and "may be lost" in msg, (kind, msg)
            w.join(HANG_S)
            assert w.exitcode == 0
            wait_for(lambda: c.stats()["tables"]["t"]["orphaned"] == 0,
                     "the slot to be freed once its writer reconnected")
            ids = committed_ids(d.segment("t"))  # asserts no row is torn
            assert POISON not in ids.tolist()
            b = t.sample(256)
            assert torn(b.data) == 0 and POISON not in b.data["id"].tolist()
    finally:
        if w.is_alive():
            os.kill(w.pid, signal.SIGCONT)
        reap([w])
