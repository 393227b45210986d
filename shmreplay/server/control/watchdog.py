"""systemd's notify protocol: READY, STOPPING, the watchdog and STATUS lines.

``notify`` sends one datagram to $NOTIFY_SOCKET (a no-op without it).
``Watchdog.run`` is the daemon's liveness proof: every half of
$WATCHDOG_USEC it asks the engine thread for a one-line summary (tables,
items, clients) and, only when the engine answered within that half, sends
``WATCHDOG=1`` with ``STATUS=``.  The ask runs on the event loop and is
answered on the engine thread, so one ping vouches for both: a stalled
engine (or a blocked loop) stops the pings, systemd's ``WatchdogSec``
runs out, and ``Restart=on-failure`` starts a daemon that re-adopts the
tables (control/recovery.py).  Without a watchdog the STATUS line is
refreshed every ``STATUS_EVERY_S``.

Who calls it: the daemon's event loop (``daemon.py``); ``summary`` runs on
the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger("shmreplayd")

STATUS_EVERY_S = 10.0


def notify(state: str) -> bool:
    """Send ``state`` ("READY=1", "WATCHDOG=1\\nSTATUS=...") to systemd;
    False when not run by systemd or the send failed (logged)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
            s.sendall(state.encode())
            return True
        except OSError as exc:
            log.warning("sd_notify(%s) failed: %s", state.split("\n")[0], exc)
            return False


def watchdog_interval() -> float | None:
    """Seconds between pings (half of WATCHDOG_USEC), or None when systemd
    asked for no watchdog, or asked it of another process (WATCHDOG_PID)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


def summary(engine) -> str:  # engine thread
    """The STATUS line: tables, items, clients."""
    items = sum(t.size for t in engine.tables.values())
    n = len(engine.tables)
    return (f"{n} table{'s' * (n != 1)}, {items:,} items, {len(engine.clients)} "
            f"client{'s' * (len(engine.clients) != 1)}")


class Watchdog:
    def __init__(self, control, engine):
        """``control``: the ``ControlServer`` (its ``call`` runs a function
        on the engine thread); ``engine``: the ``Engine``."""
        self.control, self.engine = control, engine
        self.interval = watchdog_interval()
        self.pings = 0
        self.missed = 0

    async def run(self) -> None:
        every = self.interval or STATUS_EVERY_S
        if self.interval:
            log.info("systemd watchdog: a ping every %.1f s while the engine answers", every)
        while True:
            await asyncio.sleep(every)
            # not asyncio.wait_for: on Python < 3.12 it swallows a cancel that
            # comes in the loop pass the engine's answer does (it returns the
            # answer instead), and this loop then ran on after the daemon's
            # stop cancelled it, so the stop waited for it for ever (seen as
            # a daemon that did not stop on SIGTERM under load)
            answer = asyncio.ensure_future(self.control.call(summary, self.engine))
            try:
                done, _ = await asyncio.wait({answer}, timeout=every)
            finally:
                if not answer.done():
                    answer.cancel()
            if not done:
                self.missed += 1
                log.error("the engine thread did not answer within %.1f s: no watchdog ping "
                          "(systemd restarts a daemon that stays so for WatchdogSec)", every)
                continue
            line = answer.result()
            if self.interval:
                self.pings += notify(f"WATCHDOG=1\nSTATUS={line}")
            else:
                notify(f"STATUS={line}")
