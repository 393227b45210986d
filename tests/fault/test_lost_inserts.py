"""Promise 2, the client's side: with ``reconnect=True``, inserts that were
not flushed when the daemon died are never vouched for, however the client
first noticed the restart.  ``flush()`` (or ``close()``) raises the "may be
lost" ``DaemonUnavailable`` once; the next flush vouches only for what came
after."""


import numpy as np
import pytest

import shmreplay

from faults import FIELDS, HANG_S, committed_ids, rows, wait_for

TABLE = [{"name": "t", "capacity": 1024, "sampler": "uniform", "fields": FIELDS}]

NOTICE = {  # calls that find the daemon gone and reconnect before any flush
    "stats": lambda c, t: c.stats(),
    "sample": lambda c, t: t.sample(1, timeout=HANG_S),
    "insert": lambda c, t: t.insert_batch(rows([100]), timeout=HANG_S),
}


def crashed_with_unflushed(d):
    """A reconnecting client with one flushed and 8 unflushed inserts, and a
    daemon SIGKILLed and started again under it."""
    c = shmreplay.connect(d.socket, timeout=30, reconnect=True, reconnect_timeout=HANG_S)
    t = c.table("t")
    t.insert_batch(rows([0]))
    c.flush()
    t.insert_batch(rows(np.arange(1, 9)))
    d.crash()
    d.start()
    return c, t


@pytest.mark.parametrize("notice", sorted(NOTICE))
def test_flush_after_an_earlier_call_reconnected_still_reports_the_loss(start_daemon, notice):
    d = start_daemon(tables=TABLE)
    c, t = crashed_with_unflushed(d)
    try:
        NOTICE[notice](c, t)
        assert c.reconnects == 1  # the call itself rode out the restart
        with pytest.raises(shmreplay.DaemonUnavailable, match="may be lost"):
            c.flush()
        c.flush()  # said once: what came after is vouched for
        t.insert_batch(rows([200]))
        c.flush()
        assert c.reconnects == 1
        # read back: what a flush vouched for is there (0 before the crash;
        # 100 if the call that noticed was that insert, and 200); of the
        # unflushed 1..8, the dead daemon may have committed some or none
        ids = set(committed_ids(d.segment("t")).tolist())
        vouched = {0, 200} | ({100} if notice == "insert" else set())
        assert vouched <= ids <= vouched | set(range(1, 9)), sorted(ids)
    finally:
        c.close()


def channel_mappings(instance: str) -> list[str]:
    """This process's mappings of the daemon's client channels (memfds
    labelled with the instance)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if f"memfd:shmreplay.{instance}.c" in line]


def test_close_reports_the_loss_and_still_releases_everything(start_daemon):
    d = start_daemon(tables=TABLE)
    c, t = crashed_with_unflushed(d)
    c.stats()
    assert c.reconnects == 1 and channel_mappings(d.instance)
    with pytest.raises(shmreplay.DaemonUnavailable, match="may be lost"):
        c.close()
    assert not channel_mappings(d.instance)  # closed before it raised
    c.close()  # closed: nothing more to say
    with pytest.raises(shmreplay.ReplayError, match="client is closed"):
        t.insert_batch(rows([9]))
    with d.connect() as admin:  # the daemon ended the lease: only the admin is left
        wait_for(lambda: admin.stats()["clients"] == 1, "the closed client's lease to end")
