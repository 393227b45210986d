"""What the Ray test modules share: the local two-node cluster (one per
module, shmreplay/bench/raycluster.py: both nodes on 127.0.0.1, the head
labelled ``replay_node``, the other ``remote_node``), and the window in
which the counts of chunks an ingest holds (coalesce.py) prove something.

Import the fixture into a module (``from rayfixtures import cluster``);
pytest then starts one cluster for that module and stops it at its end.
Every such module carries ``pytestmark = pytest.mark.xdist_group("ray")``:
one Ray at a time on the box."""

import os

import pytest

from shmreplay.bench.raycluster import LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))
# where Ray keeps state when not told otherwise: a run of the suite makes
# neither (its nodes use a temp folder of their own, token auth is off)
RAY_DEFAULTS = ("/tmp/ray", os.path.expanduser("~/.ray"))
# the largest hold_s start_ingest accepts (0..10 s): the longest a
# test can keep the ingest's own thread from inserting what it holds
HOLD_MAX = 10.0


@pytest.fixture(scope="module")
def cluster():
    """The head node's id; workers import the test helpers from this
    folder (rayproducer.py)."""
    absent = [p for p in RAY_DEFAULTS if not os.path.exists(p)]
    c = LocalCluster(remote_cpus=3, object_store_bytes=100_000_000, pythonpath=HERE)
    try:
        c.start()
        yield c.connect()
    finally:
        c.stop()
    # every process of both nodes is gone, workers too (their own process
    # groups: a paused threaded Producer once outlived the nodes' killpg)
    assert not c.leftovers()
    assert not os.path.exists(c.temp), f"the nodes' session files are left in {c.temp}"
    assert not [p for p in absent if os.path.exists(p)], "Ray made state of its own outside the run"


def before_the_ingest_thread(attempt, tries: int = 3):
    """What ``attempt(k)`` (k = 0, 1, ...) saw, from a run in which the
    ingest's thread could not yet have inserted the chunks it held.

    ``attempt`` starts an ingest with ``hold_s=HOLD_MAX`` (and a table
    ``k`` of its own), waits until it serves, notes ``time.monotonic()``,
    sends its chunks, reads the ingest's counts, and returns ``(seconds
    since that note, what it read)``.  The thread inserts held chunks no
    sooner than ``hold_s`` after the first came (``Ingest._release_held``),
    which was after the note, and the counts were read before the seconds
    were taken: if fewer than HOLD_MAX, only the calls moved them.  A run
    on a machine stalled for that long proves nothing and runs again (no
    assertion waits on the clock: this only tells a valid observation)."""
    for k in range(tries):
        seconds, got = attempt(k)
        if seconds < HOLD_MAX:
            return got
    pytest.fail(f"{tries} runs each took {HOLD_MAX} s or more: the machine stalled throughout")
