"""A client's session: its connection to the daemon at one socket path, kept
across forks and daemon restarts.

A connection is a control link (``link.py``: the socket, which is the
lease) and a command pipe (``pipe.py``).  The session opens one (the hello
handshake), opens a fresh one in a forked child (the parent's belong to the
parent's lease), and, for a client made with ``reconnect=True``, opens a
new one after the daemon went away (waiting up to ``reconnect_timeout``)
and rebinds the client's table handles to what the new daemon serves.  It
remembers whether inserts unflushed when a connection ended may be lost,
and says so once (``report_loss``).

Who calls it, all on the client's thread, one call at a time (the
``Client``'s rule):

* the ``Client``: ``request``, ``flush``, ``close``, ``abandon``,
  ``report_loss``, and the counters ``reconnects``, ``daemon_pid``;
* table handles and their slot leases, on the data plane: ``begin`` (the
  prologue of every data call), ``check_fork``, ``recover`` (the retry of
  a call the daemon went away from), and the attributes ``pipe`` (the
  command pipe now; None while there is none), ``link``, ``max_batch``
  (the most items one command may carry) and ``dirty`` (a lease sets it
  when it sends a COMMIT);
* ``retry.with_retries``'s wrapped calls: ``recover``.

It calls the table handles (the Client's cache, which it is given) only
through ``forget_connection``, ``rebind`` and ``retire``.
"""

from __future__ import annotations

import os
import time

from ..errors import DaemonUnavailable, ReplayError, ReplayTimeout, ReservationExpired, UnknownTable
from ..wire import atomics
from ..wire import records as R
from .link import ControlLink
from .pipe import CommandPipe


class Session:
    """One client's connection across forks and restarts; made by its
    ``Client`` (see the module docstring for who may call what)."""

    def __init__(self, path: str, timeout: float, reconnect: bool, reconnect_timeout: float,
                 handles: dict):
        self.path = path
        self.timeout = timeout
        self.reconnect = reconnect  # ride out a daemon restart (recover)
        self.reconnect_timeout = reconnect_timeout
        self.reconnects = 0
        self.link: ControlLink | None = None
        self.pipe: CommandPipe | None = None
        self.closed = False
        self.dirty = False  # commits sent since the last flush
        self.pid = 0        # the process the connection belongs to
        self.daemon_pid = self.max_batch = 0  # the hello of the connection now says
        self._handles = handles  # name -> table handle: the Client adds and drops them
        self._lost = False  # inserts were unflushed when a connection ended (flush says so)
        self._lease_key = 0  # this process's lease at its daemon (records.owner_key)
        self.lazy_commits = True  # Client.lazy_commits, for every pipe this session opens
        self._open()

    # ---- opening and ending a connection ----
    def _open(self) -> None:
        # the lease this process held at its last daemon: the leases were
        # voided just below, so if that daemon died, the next may reuse the
        # slots it gave us (server/tables/slots/orphans.py)
        resume = self._lease_key if self.pid == os.getpid() else 0
        self.pid = os.getpid()
        self.closed = False
        self.dirty = False
        for t in self._handles.values():  # leases belonged to the old connection
            t.forget_connection()
        # before connecting: the first call in a process loads (or compiles)
        # its numba kernel and calibrates the spin budget, up to seconds on a
        # loaded box, which inside the handshake counted against the daemon's
        # handshake_timeout_s (a Ray actor starting under load was refused
        # with "no hello and ready within 10 s")
        atomics.loads_per_second()
        link = ControlLink(self.path, self.timeout)
        try:
            hello, fds = link.hello(os.getpid(), resume)
            self.daemon_pid = hello["daemon_pid"]
            self._lease_key = R.owner_key(self.daemon_pid, hello["client_id"])
            self.max_batch = int(hello["max_batch"])
            pipe = CommandPipe(link, fds)
            pipe.set_lazy(self.lazy_commits)
            try:
                link.ready()
            except BaseException:
                pipe.close()
                raise
        except BaseException:
            link.close()
            raise
        self.link, self.pipe = link, pipe

    def set_lazy_commits(self, on: bool) -> None:
        self.lazy_commits = bool(on)
        if self.pipe is not None:
            self.pipe.set_lazy(self.lazy_commits)

    def abandon(self) -> None:
        """Drop the link and pipe of a lease that is over (no flush)."""
        if self.link is not None:
            self.link.close()
            self.pipe.close()
            self.link = self.pipe = None

    def check_fork(self) -> None:
        """In a forked child, open the child's own connection first."""
        if self.pid != os.getpid():
            # the parent's link and pipe belong to the parent's lease
            self.link = self.pipe = None
            self._open()

    def close(self, flush) -> None:
        """End the lease: ``flush()`` first (bounded), then, like a flush,
        raise DaemonUnavailable if inserts made before a daemon restart may
        be lost (no other error of that flush is raised).  A closed session,
        one without a connection, or a forked child's copy just closes."""
        if self.closed or self.link is None or self.pid != os.getpid():
            self.closed = True
            return
        failed = None
        try:
            flush()
        except ReplayError as exc:
            failed = exc
        finally:
            self.closed = True
            self.abandon()
        self.report_loss(failed)  # a quiet close would vouch for them

    # ---- calls ----
    def begin(self) -> None:
        """Prologue of data calls: fork check, replies that arrived, deferred errors."""
        if self.closed:
            raise ReplayError("client is closed")
        if self.pid != os.getpid():
            self.check_fork()
        pipe = self.pipe
        if pipe is None:
            raise DaemonUnavailable(f"no connection to the daemon at {self.path} (a reconnect failed)")
        # has_pending first: cheaper when, as usually, nothing came; answers
        # stay for their callers (errors_waiting)
        if pipe.resp.has_pending() and pipe.errors_waiting():
            pipe.drain()
        if pipe.deferred is not None:
            self._raise_deferred()

    def request(self, op: str, **args) -> dict:
        """A control request (table management, admin) on the link."""
        self.check_fork()
        if self.link is None:
            raise DaemonUnavailable(f"no connection to the daemon at {self.path} (a reconnect failed)")
        return self.link.request(op, **args)

    def flush(self) -> None:
        """Wait until every command sent on the pipe is applied (after
        ``begin``); the commits before it are then vouched for."""
        pipe = self.pipe
        pipe.wait(pipe.send(R.put_flush), lambda rec, pay: None)
        self.dirty = False
        self._raise_deferred()

    def _raise_deferred(self) -> None:
        """Raise the error a streamed command (a commit) got.  One that came
        after its reservation expired (the client stalled past the daemon's
        reservation_timeout_s) may be one of many: every lease of every
        table is renewed first, so inserts from now on go into new
        reservations."""
        try:
            self.pipe.raise_deferred()
        except ReservationExpired:
            for t in self._handles.values():
                t.renew_leases()
            raise

    # ---- daemon restarts ----
    def recover(self) -> bool:
        """After DaemonUnavailable in a call that may run again: reconnect
        and return True, or False (the error stands) if this client does not
        ride out restarts or is closed."""
        if not self.reconnect or self.closed:
            return False
        self._reopen()
        return True

    def _reopen(self) -> None:
        """Open a new lease, waiting up to reconnect_timeout for a daemon, and
        rebind every table handle to what the daemon serves now.  Whatever was
        unflushed on the old lease is marked as possibly lost."""
        self.abandon()
        lost = [t.forget_connection() for t in self._handles.values()]
        self._lost = self._lost or self.dirty or any(lost)
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            try:
                self._open()
                break
            except (DaemonUnavailable, ReplayTimeout) as exc:
                if time.monotonic() > deadline:
                    raise DaemonUnavailable(f"no daemon came back at {self.path} within "
                                            f"{self.reconnect_timeout} s: {exc}") from None
                time.sleep(0.1)
        self.reconnects += 1
        for name, t in list(self._handles.items()):
            try:
                t.rebind(self.link.request("open_table", name=name)["table"])
            except UnknownTable:
                t.retire()
                del self._handles[name]

    def report_loss(self, failed: ReplayError | None = None) -> None:
        """Raise DaemonUnavailable, once, if inserts unflushed when a daemon
        went away may be lost.  Never from inside a ``@retried`` call: its
        retry would catch the notice, reconnect and succeed, vouching for them.
        ``failed``: the error of a flush that could not vouch for them either."""
        if not self._lost:
            return
        self._lost = False
        if failed is not None:
            raise DaemonUnavailable(f"inserts not flushed before the daemon went away may be lost, "
                                    f"and the last flush failed: {failed}") from failed
        raise DaemonUnavailable("the daemon was restarted since the last flush; inserts made before "
                                "the restart may be lost (those since are applied)")
