"""A real shmreplayd whose clean stop lingers on demand (fault injection
for tests/fault/test_shutdown_wait.py): while the file ``hold`` exists in
$SHMREPLAY_TEST_PAUSE_DIR, the daemon, once asked to stop, does not begin
its shutdown (after creating ``stopping`` there): its process and socket
stay, as a daemon slow to stop would leave them; it goes on once the test
removes ``hold``.  The wait ends by itself after 10 minutes (a hang guard,
so a failed test cannot leave the daemon stuck)."""

import asyncio
import os
import sys
import time

# the repository's package, not an installed copy (this file runs as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shmreplay.server import daemon  # noqa: E402

_shutdown = daemon.Daemon.shutdown


async def _linger_then_shut_down(self):
    where = os.environ["SHMREPLAY_TEST_PAUSE_DIR"]
    hold = os.path.join(where, "hold")
    if os.path.exists(hold):
        open(os.path.join(where, "stopping"), "w").close()
        deadline = time.monotonic() + 600
        while os.path.exists(hold) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    await _shutdown(self)


daemon.Daemon.shutdown = _linger_then_shut_down

if __name__ == "__main__":
    sys.exit(daemon.main())
