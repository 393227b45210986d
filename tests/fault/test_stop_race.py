"""A stop that lands in the loop pass where the watchdog's engine call
answers: the watchdog's task ends on its cancel (it ran on, and the
daemon's stop waited for it for ever: the suite's 2 GiB cgroup test saw
daemons that did not stop on SIGTERM under load, SIGUSR1's stacks showing
an idle event loop), and the stop is bounded even for a periodic task that
ignores its cancel.

The first test arranges the interleaving exactly, which a daemon under
SIGTERM does only by chance: the real ``Watchdog`` runs on an event loop
against a control plane whose engine call is a future the test answers
in the same synchronous step as it cancels the task.  The second runs a
real daemon with a periodic task that swallows every cancel
(``deaf_daemon.py``) and stops it."""

import asyncio
import os
import signal
import sys

from shmreplay.server.control.watchdog import Watchdog
from waiting import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


class AnsweredByTheTest:
    """The control plane's side of an engine call: ``call`` hands back a
    future the test completes when it chooses."""

    def __init__(self, loop):
        self.loop = loop
        self.pending: list[asyncio.Future] = []

    def call(self, fn, *args):
        fut = self.loop.create_future()
        self.pending.append(fut)
        return fut


def test_the_watchdog_ends_on_a_cancel_that_comes_with_the_engines_answer(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)  # notify() is then a no-op

    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        control = AnsweredByTheTest(loop)
        wd = Watchdog(control, engine=None)
        wd.interval = 0.001  # its first call comes at once
        task = loop.create_task(wd.run())
        while not control.pending:  # a hang guard below bounds this with the test's timeout
            await asyncio.sleep(0.001)
        control.pending[0].set_result("1 table, 0 items, 0 clients")
        task.cancel()  # the same pass: the answer's wake-up and the cancel meet
        done, _ = await asyncio.wait({task}, timeout=10.0)  # a hang guard
        if not done:
            task.cancel()  # whatever it does now, end the scenario
            for f in control.pending:
                if not f.done():
                    f.set_result("")
            return "ran on after its cancel"
        return "cancelled" if task.cancelled() else f"ended: {task.exception()!r}"

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=60)) == "cancelled"


def test_a_stop_does_not_wait_for_ever_on_a_periodic_task_that_ignores_its_cancel(start_daemon):
    """... nor does a second SIGTERM during that stop cut it short (the
    default action, once the loop's handler was gone, killed it with -15)."""
    d = start_daemon(command=[sys.executable, os.path.join(HERE, "deaf_daemon.py")])
    with d.connect() as c:
        assert c.list_tables() == []
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "shutting down" in d.log(), "the stop to begin")
    d.proc.send_signal(signal.SIGTERM)  # an impatient operator, in the stop's 10 s wait or after it
    code = d.stop(timeout=120)  # a third, if it still runs  # the daemon's own bound is 10 s; this is the test's hang guard
    assert code == 0, d.hang_dump or d.log()[-3000:]
    assert "did not end within 10 s of its cancel; stopping without it" in d.log(), d.log()[-3000:]
