"""Issue 21, item 4: a durable table whose syncs fail backs off, logs once
per back-off step, and tells a writer that waits for its slots why; once
the cause is mended, the next try lands and inserts go on.

The failure here is a storage directory made writable by others, which the
daemon refuses to write in.  A full filesystem no longer fails a sync: its
space is reserved when the table is made (issue 34, item 6;
``test_shares.py`` fills a real tmpfs, with ``small_disk`` and ``fill_up``
from here)."""

import contextlib
import math
import os
import re
import subprocess
import time

import numpy as np
import pytest

import shmreplay

from faults import FIELDS, rows, wait_for
from waiting import HANG_S

@contextlib.contextmanager
def tmpfs(mnt):
    """A 4 MiB tmpfs at ``mnt`` (made here) only root can write (mode 0755: a
    safe storage_dir's parent), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small filesystem")
    mnt.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk") as mnt:
        yield mnt


def fill_up(path) -> None:
    """Take every free byte of the filesystem under ``path``."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\xff" * 65536)
                f.flush()
        except OSError:
            pass


def test_a_failing_sync_backs_off_and_says_why(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    d = start_daemon(tables=[{"name": "d", "capacity": 256, "fields": FIELDS, "storage_dir": store}],
                     storage_dirs=[store], sync_interval_s=3600)
    with d.connect() as c:
        t = c.table("d")
        t.insert_batch(rows(np.arange(256)))
        c.flush()
        c.sync("d")  # full, and its file lists every item: now each eviction retires a slot
        mode = os.stat(store).st_mode & 0o7777
        os.chmod(store, 0o777)  # an operator's slip: the daemon writes in it no more
        t0 = time.monotonic()
        with pytest.raises(shmreplay.SlotsBusy):
            for lo in range(256, 4096, 64):  # until the retired slots are all a sync could give
                t.insert_batch(rows(np.arange(lo, lo + 64)), timeout=2)
        st = wait_for(lambda: (s := c.stats()["tables"]["d"])["sync_failures"] >= 3 and s,
                      "three failed syncs")
        spent = time.monotonic() - t0
        # once a sync failed (on a loaded disk the first may take longer than the inserts' 2 s),
        # a writer held back is told why
        with pytest.raises(shmreplay.SlotsBusy, match=r"the syncs of this table to \S+ are failing "
                                                      r"\(.*writable by others"):
            t.insert_batch(rows(np.arange(4096, 4160)), timeout=0.1)
        assert "writable by others" in st["sync_error"]
        # one attempt and one line per back-off step (0.5 s, doubling), not per insert: however
        # slow the box, no more attempts than the steps the time spent allows (and a margin of 2)
        assert st["sync_failures"] <= 2 + math.log2(spent / 0.5 + 1) + 2, (st["sync_failures"], spent)
        # one line per failure: the daemon logs each failure as it counts it (no await between),
        # so a log read after one stats call and before another holds as many lines as the first
        # says at least, and the second at most (a try may fail in between)
        lines = re.findall(r"sync of table d to \S+ failed: .*; the copy of the sync before stays, "
                           r"and the next try is in ([0-9.]+) s", d.log())
        later = c.stats()["tables"]["d"]["sync_failures"]
        waits = [float(w) for w in lines]
        assert st["sync_failures"] <= len(waits) <= later, (st["sync_failures"], waits, later)
        assert waits == [min(60.0, 0.5 * 2 ** i) for i in range(len(waits))], waits  # 0.5 s, doubling up to 60 s
        os.chmod(store, mode)  # mended: the next try lands, and inserts go on
        # a waiting writer keeps asking for the sync (the back-off's next step is at most 60 s away)
        t.insert_batch(rows(np.arange(5000, 5064)), timeout=60 + HANG_S)
        c.flush()
        assert c.stats()["tables"]["d"]["sync_error"] is None
        assert "sync of table d to" in d.log() and "succeeds again" in d.log()
        c.drop_table("d")  # a durable table outlives a clean stop: the test leaves nothing
