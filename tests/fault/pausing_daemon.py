"""A real shmreplayd whose checkpoint writes pause on demand (fault
injection for tests/fault/test_checkpoints.py): each checkpoint write,
after the engine's snapshot and before the first row is copied, creates
the file ``copying`` in $SHMREPLAY_TEST_PAUSE_DIR and waits until the test
creates ``go`` there.  While it waits, the test does what it wants to see
happen during the copy: a daemon that stopped the engine for the write
would never serve it.  The wait ends by itself after 10 minutes (a hang
guard, so a failed test cannot leave the daemon stuck)."""

import os
import sys
import time

# the repository's package, not an installed copy (this file runs as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shmreplay.server.disk import checkpoint  # noqa: E402

from shmreplay.server import daemon  # noqa: E402

_write_rows = checkpoint._write_rows


def _pause_then_write_rows(*args, **kwargs):
    where = os.environ["SHMREPLAY_TEST_PAUSE_DIR"]
    open(os.path.join(where, "copying"), "w").close()
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(where, "go")) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _write_rows(*args, **kwargs)


checkpoint._write_rows = _pause_then_write_rows

if __name__ == "__main__":
    sys.exit(daemon.main())
