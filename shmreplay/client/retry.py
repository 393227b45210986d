"""Calls that run again after a reconnect: the ``@retried`` mark and the
subclasses whose marked calls do it.

``@retried`` marks a public call that may run again, once, after the client
reconnected, if the daemon went away during it (``DaemonUnavailable``).
``with_retries(cls)`` makes the subclass whose marked calls do that; a
client made with ``reconnect=True`` uses those subclasses, so the calls of
every other client pay nothing for the wrapper (insert1 is ~10% faster
without it).  A call that ran again may have been applied twice if the
daemon applied it just before it died; inserts not yet flushed may be
lost, which the next ``flush()`` or ``close()`` reports.  Reconnecting and
that report are the session's (``session.py``); this module only decides
when a call runs again.  All of it runs on the caller's thread, like the
calls.
"""

from __future__ import annotations

import functools

from ..errors import DaemonUnavailable


def retried(method):
    method.__retried__ = True
    return method


def _retrying(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except DaemonUnavailable:
            if not self._session.recover():  # closed: the error stands
                raise
            return method(self, *args, **kwargs)
    return call


def with_retries(cls):
    """A subclass of ``cls`` whose ``@retried`` calls reconnect and run again.
    ``cls``'s instances keep their ``session.Session`` in ``_session``."""
    wrapped = {}
    for base in reversed(cls.__mro__):  # a subclass's own override wins
        wrapped.update({name: _retrying(fn) for name, fn in vars(base).items()
                        if getattr(fn, "__retried__", False)})
    return type(f"Reconnecting{cls.__name__}", (cls,), {"__module__": cls.__module__,
                                                         "__doc__": cls.__doc__, **wrapped})
