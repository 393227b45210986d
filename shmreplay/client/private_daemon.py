"""``shmreplay.Server``: a private daemon for one program, as ``reverb.Server``.

    with shmreplay.Server(tables=[dict(name="replay", capacity=100_000,
                                       fields={"obs": ("float32", (4,))})]) as server:
        client = server.connect()
        ...

A ``Server`` starts ``shmreplayd`` as a child process on a private socket
in a fresh 0700 temporary directory, under an instance name of its own,
so it shares nothing with a system daemon or another program's Server.
Its tables are this user's alone: the socket, the segments and any rows
files are mode 0600 (``PRIVATE_MODE``), so no other user, not even one who
shares this process's primary group, can connect, map or write them.
``group=`` opens them to one group on purpose: mode 0660 in that group, the
group allowed to connect, and the socket's directory made reachable by it.
A config file (``config=``) is honoured for the keys it sets; those it
leaves out get the same private defaults.  The instance lock goes in this
user's runtime directory (``wire/names.py`` ``runtime_dir``), or, for a user
who has none, in the Server's own directory (``runtime_dir`` says which).  It
returns once the daemon serves and every table in ``tables`` exists (made
with ``Client.create_table``, so they take its forms and raise its
errors).  ``stop()`` (and leaving the ``with`` block) shuts it down with
SIGTERM, waits, and checks that nothing of its instance is left in
/dev/shm; a daemon that fails to start raises ``ServerFailed`` with the
tail of its log.

The daemon is the child of the thread that made the Server and gets
SIGTERM if that thread dies (``PR_SET_PDEATHSIG``), so a program killed
with SIGKILL leaves no daemon running behind it (its segments stay until
``shmreplay cleanup --instance``; the daemon's own SIGTERM path removes
them when it gets to run).  Make a Server from the main thread, or from a
thread that outlives it.  A program that gets SIGTERM (and has no handler
of its own) or SIGINT unwinds (``SystemExit(143)``, ``KeyboardInterrupt``),
and every Server not yet stopped is stopped at exit: its folder goes too.

Who calls it: the program that owns it, from one thread.  ``connect()``
may be called as often as needed; each ``Client`` is for one thread (and
is picklable into child processes, which connect by the same socket).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import grp
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..errors import DaemonUnavailable, ReplayError
from ..wire.names import SHM_DIR, SOCKET_PATH_MAX, runtime_dir
from .client import Client, connect

START_TIMEOUT_S = 120.0   # the first start on a machine compiles the kernels (seconds)
STOP_TIMEOUT_S = 60.0
_counter = itertools.count()
_PR_SET_PDEATHSIG = 1
PRIVATE_MODE = "0600"   # the socket, segments and rows files of a Server without group=
GROUP_MODE = "0660"     # with group=: that group reads and writes rows, as a shared daemon's members


class ServerFailed(ReplayError):
    """The private daemon did not start, or did not stop cleanly."""


def _die_with_parent(preexec=None) -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the daemon outlives a killed parent, as a Popen would
    if preexec is not None:
        preexec()


def _group_id(group) -> int:
    """``group=``'s gid; this process must be in it (the daemon, its child,
    gives its objects to that group, which only a member or root may)."""
    try:
        gid = grp.getgrgid(group).gr_gid if isinstance(group, int) else grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ReplayError(f"Server(group={group!r}): no such group on this machine") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ReplayError(f"Server(group={group!r}): this process is not in that group, so its "
                          "daemon cannot give the tables to it; run as a member, or leave group out")
    return gid


def buffer_options(socket: str | None, storage_dir: str | None, seed: int | None) -> dict:
    """``Server``'s options for an in-process buffer's private daemon (the
    SB3 and TorchRL buffers): its table's storage folder, its sampler seed.
    ``seed`` with ``socket`` is refused: a shared daemon's sampler is seeded
    by its own config, and a buffer that took the seed would not be seeded."""
    if socket is not None and seed is not None:
        raise ReplayError("seed= seeds a private daemon; a shared daemon's sampler is seeded by "
                          "its own config ([daemon] seed): leave seed= out with socket=")
    return {**({"storage_dirs": [storage_dir]} if storage_dir else {}), **({} if seed is None else {"seed": seed})}


def _private_config(doc: dict, group) -> dict:
    """``doc`` (a parsed config) with the access keys it leaves out set:
    this user only, or ``group`` (its members connect and map)."""
    d = dict(doc.get("daemon", {}))
    if group is None:
        d.setdefault("segment_mode", PRIVATE_MODE)
    else:
        d.setdefault("segment_mode", GROUP_MODE)
        d.setdefault("group", group)
        d.setdefault("allowed_groups", [group])
    return {**doc, "daemon": d}


def _toml_doc(doc: dict) -> str:
    """A config as TOML again (``[daemon]`` and ``[[tables]]``, the only
    sections a config has; nested values inline)."""
    unknown = sorted(set(doc) - {"daemon", "tables"})
    if unknown:
        raise ReplayError(f"config: unknown sections {unknown}; a config has [daemon] and [[tables]]")
    out = ["[daemon]"] + [f"{k} = {_toml_value(v)}" for k, v in doc.get("daemon", {}).items()]
    for t in doc.get("tables", []):
        out += ["[[tables]]"] + [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in t.items()]
    return "\n".join(out) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table; quoted keys take any name
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise ReplayError(f"daemon option value {v!r}: give a bool, number, string or list of them")


class Server:
    """A private ``shmreplayd`` (see the module docstring)."""

    def __init__(self, tables=(), config: str | None = None, instance: str | None = None,
                 timeout: float = START_TIMEOUT_S, python: str | None = None, group=None,
                 preexec=None, **daemon_options):
        """``tables``: dicts of ``Client.create_table``'s arguments (name,
        capacity, fields, sampler, ...), or ``("queue", dict)`` pairs for
        ``create_queue``.  ``config``: a shmreplayd TOML file (its socket
        and instance are overridden); or ``daemon_options``: keys of its
        ``[daemon]`` section (``learner_spin_us=0``, ``log_level="info"``),
        not both.  ``instance``: the shared-memory name prefix (default
        ``local<pid>x<n>``).  ``python``: the interpreter to run the daemon
        with (default this one).  ``group``: a group name or gid whose
        members may connect and map the tables (default: none, this user
        only; see the module docstring).  ``preexec``: a callable run in the
        daemon's process before it starts (``Popen``'s ``preexec_fn``), for
        what must hold from its first page on: ``os.nice``, joining a
        cgroup; the benchmarks use it."""
        if config is not None and daemon_options:
            raise ReplayError("give daemon options in the config file or as keywords, not both")
        gid = None if group is None else _group_id(group)
        self.instance = instance or f"local{os.getpid()}x{next(_counter)}"
        self.owner_pid = os.getpid()  # a forked child's copy is not its to stop at exit
        self.dir = tempfile.mkdtemp(prefix="shmreplay-server-")
        if len(os.fsencode(os.path.join(self.dir, "shmreplay.sock"))) > SOCKET_PATH_MAX:
            # a long $TMPDIR leaves no room for a Unix socket's path: a
            # private 0700 directory under /tmp instead
            os.rmdir(self.dir)
            self.dir = tempfile.mkdtemp(prefix="shmreplay-server-", dir="/tmp")
        if gid is not None:  # its members reach the socket: pass through, never list or write
            os.chown(self.dir, -1, gid)
            os.chmod(self.dir, 0o710)
        self.socket = os.path.join(self.dir, "shmreplay.sock")
        env = {**os.environ, "SHMREPLAY_SOCKET": self.socket}
        try:  # the instance lock's directory: this user's runtime directory
            self.runtime_dir = runtime_dir()
        except ReplayError:  # none this user has (no XDG_RUNTIME_DIR, no home): the private one
            self.runtime_dir = env["RUNTIME_DIRECTORY"] = self.dir
        self.log_path = os.path.join(self.dir, "shmreplayd.log")
        self.proc: subprocess.Popen | None = None
        self._clients: list[Client] = []
        try:
            if config is None:
                doc = {"daemon": daemon_options}
            else:
                try:
                    with open(config, "rb") as f:
                        doc = tomllib.load(f)
                except (OSError, tomllib.TOMLDecodeError) as exc:
                    raise ReplayError(f"cannot read config {config}: {exc}") from None
            self.config = os.path.join(self.dir, "shmreplayd.toml")
            # both 0600: with group= the directory lets the group pass through
            with open(os.open(self.config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(_toml_doc(_private_config(doc, None if gid is None else gid)))
            self._argv = [python or sys.executable, "-m", "shmreplay.server.daemon", "--config", self.config,
                          "--socket", self.socket, "--instance", self.instance]
            self._env, self._preexec = env, preexec
            self._launch(os.O_EXCL)
            admin = self._wait_ready(timeout)
            try:
                for t in tables:
                    if isinstance(t, tuple) and t and t[0] == "queue":
                        admin.create_queue(**t[1])
                    else:
                        admin.create_table(**t)
            finally:
                admin.close()
        except BaseException:
            self.stop(check=False)
            raise
        _live.add(self)
        _unwind_on_sigterm()

    def _launch(self, mode: int) -> None:
        """Start ``shmreplayd`` on this Server's socket and instance, its
        output appended to the log (``mode``: O_EXCL the first time)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | mode
        with open(os.open(self.log_path, flags, 0o600), "ab") as log:
            self.proc = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self._env,
                                         preexec_fn=functools.partial(_die_with_parent, self._preexec))

    def restart(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the daemon again after it died (SIGKILL, OOM, a crash), on
        the same socket and instance: it adopts the tables the dead one
        left in /dev/shm (server/control/recovery.py), so their items come
        back; clients with ``reconnect=True`` carry on.  Returns once it
        serves.  Refused while it runs, once stopped, and in a forked copy;
        the daemon is a child of the calling thread from then on."""
        if self.owner_pid != os.getpid() or self.proc is None:
            raise ReplayError("this Server is stopped (or a forked copy): make a new one")
        if self.proc.poll() is None:
            raise ReplayError(f"shmreplayd (pid {self.proc.pid}) is running: stop or kill it first")
        self._launch(0)
        self._wait_ready(timeout).close()

    def _wait_ready(self, timeout: float) -> Client:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"shmreplayd exited with code {self.proc.returncode} during "
                                   f"startup; its log ends:\n{self.log_tail()}")
            try:
                return connect(self.socket, timeout=30.0)
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise ServerFailed(f"shmreplayd did not serve within {timeout} s; its log "
                                       f"ends:\n{self.log_tail()}") from None
                time.sleep(0.02)

    # ---- use ----
    def connect(self, timeout: float = 30.0, reconnect: bool = False) -> Client:
        """A new ``Client`` of this daemon (closed by ``stop`` if still open)."""
        if self.proc is None or self.proc.poll() is not None:
            raise DaemonUnavailable("this Server is stopped")
        c = connect(self.socket, timeout=timeout, reconnect=reconnect)
        self._clients.append(c)
        return c

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def leftovers(self) -> list[str]:
        """This instance's objects in /dev/shm (none once stopped cleanly)."""
        mark = f"shmreplay.{self.instance}."
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mark) or n.startswith("sem." + mark))

    # ---- stop ----
    def stop(self, check: bool = True) -> int:
        """SIGTERM the daemon and wait (a daemon that does not stop in
        STOP_TIMEOUT_S is killed); remove the temporary directory.  With
        ``check``, raise ServerFailed if it did not exit 0 or left objects
        in /dev/shm.  Returns its exit code; idempotent.  In a forked child
        (a worker holding a copy) it only drops the copy: the daemon is
        the parent's."""
        if self.owner_pid != os.getpid():
            self.proc, self._clients = None, []
            _live.discard(self)
            return 0
        for c in self._clients:
            try:
                c.close()
            except ReplayError:
                pass  # the daemon may already be gone; stop is what was asked
        self._clients = []
        proc, code = self.proc, 0
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        tail = self.log_tail()
        shutil.rmtree(self.dir, ignore_errors=True)
        _live.discard(self)
        left = self.leftovers() if proc is not None else []
        self.proc = None
        if check and proc is not None and (code != 0 or left):
            raise ServerFailed(f"shmreplayd exited with code {code}, left {left or 'nothing'} in "
                               f"/dev/shm; its log ends:\n{tail}")
        return code

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.stop(check=exc_type is None)

    def __del__(self):
        if (getattr(self, "proc", None) is not None and getattr(self, "owner_pid", None) == os.getpid()
                and self.proc.poll() is None):
            self.proc.send_signal(signal.SIGTERM)


# Servers not stopped yet: stopped at exit, so a program that ends without
# ``stop`` (an exception outside a ``with``, SIGINT's KeyboardInterrupt, the
# SystemExit SIGTERM raises below) leaves no folder or daemon behind
_live: "weakref.WeakSet[Server]" = weakref.WeakSet()


@atexit.register
def _stop_live() -> None:
    for server in list(_live):  # stop() leaves a forked child's copies alone
        try:
            server.stop(check=False)
        except Exception:  # at exit: the rest still get stopped
            pass


def _unwind_on_sigterm() -> None:
    """SIGTERM's default kills the program where it stands, leaving a
    Server's folder (its daemon, a child, gets SIGTERM and cleans /dev/shm
    itself): where the program has no handler of its own, and this is the
    main thread, SIGTERM raises ``SystemExit(143)`` instead, as SIGINT
    raises KeyboardInterrupt, so ``with`` blocks and ``atexit`` stop every
    Server.  A program's own SIGTERM handler is left alone."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _sigterm_exit)


def _sigterm_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)
