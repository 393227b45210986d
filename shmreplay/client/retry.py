"""Riding out a daemon restart: reconnecting, the calls run again, and
telling the caller what may be lost.

``@retried`` marks a public call that may run again, once, after the client
reconnected (``reconnect``), if the daemon went away during it
(``DaemonUnavailable``).  ``with_retries(cls)`` makes the subclass whose
marked calls do that; a client made with ``reconnect=True`` uses those
subclasses, so the calls of every other client pay nothing for the wrapper
(insert1 is ~10% faster without it).  A call that ran again may have been
applied twice if the daemon applied it just before it died; inserts not yet
flushed may be lost, which the next ``flush()`` or ``close()`` reports
(``report_loss``).  All of it runs on the caller's thread, like the calls.
"""

from __future__ import annotations

import functools
import time

from ..errors import DaemonUnavailable, ReplayError, ReplayTimeout, UnknownTable


def reconnect(client) -> None:
    """Open a new lease, waiting up to reconnect_timeout for a daemon, and
    rebind every table handle to what the daemon serves now.  Whatever was
    unflushed on the old lease is marked as possibly lost."""
    client._abandon()
    lost = [t._forget_connection() for t in client._tables.values()]
    client._lost = client._lost or client._dirty or any(lost)
    deadline = time.monotonic() + client.reconnect_timeout
    while True:
        try:
            client._open()
            break
        except (DaemonUnavailable, ReplayTimeout) as exc:
            if time.monotonic() > deadline:
                raise DaemonUnavailable(f"no daemon came back at {client.path} within "
                                        f"{client.reconnect_timeout} s: {exc}") from None
            time.sleep(0.1)
    client.reconnects += 1
    for name, t in list(client._tables.items()):
        try:
            t._rebind(client._link.request("open_table", name=name)["table"])
        except UnknownTable:
            t.id = 0  # no table has id 0: the handle's next call raises UnknownTable
            del client._tables[name]


def report_loss(client, failed: ReplayError | None = None) -> None:
    """Raise DaemonUnavailable, once, if inserts unflushed when a daemon
    went away may be lost.  Never from inside a ``@retried`` call: its
    retry would catch the notice, reconnect and succeed, vouching for them.
    ``failed``: the error of a flush that could not vouch for them either."""
    if not client._lost:
        return
    client._lost = False
    if failed is not None:
        raise DaemonUnavailable(f"inserts not flushed before the daemon went away may be lost, "
                                f"and the last flush failed: {failed}") from failed
    raise DaemonUnavailable("the daemon was restarted since the last flush; inserts made before "
                            "the restart may be lost (those since are applied)")


def retried(method):
    method.__retried__ = True
    return method


def _retrying(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except DaemonUnavailable:
            client = getattr(self, "_client", self)
            if client._closed:
                raise
            reconnect(client)
            return method(self, *args, **kwargs)
    return call


def with_retries(cls):
    """A subclass of ``cls`` whose ``@retried`` calls reconnect and run again."""
    wrapped = {name: _retrying(fn) for name, fn in vars(cls).items()
               if getattr(fn, "__retried__", False)}
    return type(f"Reconnecting{cls.__name__}", (cls,), {"__module__": cls.__module__,
                                                         "__doc__": cls.__doc__, **wrapped})
