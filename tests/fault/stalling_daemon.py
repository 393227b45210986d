"""A real shmreplayd whose engine thread stalls on demand (fault injection
for tests/fault/test_watchdog.py): while the file ``stall`` exists in
$SHMREPLAY_TEST_PAUSE_DIR, the engine's serving pass blocks (after
creating ``stalled`` there), as a deadlocked or runaway engine would; it
goes on once the test removes ``stall``.  The stall ends by itself after
10 minutes (a hang guard, so a failed test cannot leave the daemon stuck)."""

import os
import sys
import time

# the repository's package, not an installed copy (this file runs as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shmreplay.server import daemon  # noqa: E402
from shmreplay.server.engine.engine import Engine  # noqa: E402

_serve_all = Engine._serve_all


def _stall_then_serve(self):
    where = os.environ["SHMREPLAY_TEST_PAUSE_DIR"]
    if os.path.exists(os.path.join(where, "stall")):
        open(os.path.join(where, "stalled"), "w").close()
        deadline = time.monotonic() + 600
        while os.path.exists(os.path.join(where, "stall")) and time.monotonic() < deadline:
            time.sleep(0.01)
    return _serve_all(self)


Engine._serve_all = _stall_then_serve

if __name__ == "__main__":
    sys.exit(daemon.main())
