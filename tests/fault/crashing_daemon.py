"""A real shmreplayd whose engine thread dies on demand (fault injection for
tests/fault/test_engine_faults.py): once the file named by
$SHMREPLAY_TEST_CRASH_FILE exists, the engine's next pass over its clients
raises outside every per-client guard, as a bug in the engine itself would."""

import os
import sys

# the repository's package, not an installed copy (this file runs as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shmreplay.server import daemon  # noqa: E402

from shmreplay.server.engine import engine  # noqa: E402

_serve_all = engine.Engine._serve_all


def _serve_all_or_crash(self):
    if os.path.exists(os.environ["SHMREPLAY_TEST_CRASH_FILE"]):
        raise RuntimeError("injected engine failure")
    return _serve_all(self)


engine.Engine._serve_all = _serve_all_or_crash

if __name__ == "__main__":
    sys.exit(daemon.main())
