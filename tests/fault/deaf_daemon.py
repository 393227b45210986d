"""A real shmreplayd with one more periodic task, which swallows every
cancel and runs on (fault injection for tests/fault/test_stop_race.py): the
daemon's stop must end anyway."""

import asyncio
import os
import sys

# the repository's package, not an installed copy (this file runs as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shmreplay.server import daemon  # noqa: E402

_startup = daemon.Daemon.startup


async def _deaf() -> None:
    deadline = asyncio.get_running_loop().time() + 600  # a hang guard: never past ten minutes
    while asyncio.get_running_loop().time() < deadline:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass  # the fault: a cancel is swallowed


async def _startup_and_deaf(self) -> None:
    await _startup(self)
    self.periodic.append(asyncio.get_running_loop().create_task(_deaf()))


daemon.Daemon.startup = _startup_and_deaf

if __name__ == "__main__":
    sys.exit(daemon.main())
