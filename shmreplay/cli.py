"""``shmreplay``: the admin command line (status, top, tables, checkpoint,
sync, drop, shutdown, cleanup, bench).  A tool at the package root: it
talks to a daemon over the control socket alone (``client/link.py``: no
command channel, so no numba and no lease), and ``cleanup`` uses the
daemon's own ownership rules.  Runs in its own process, one thread.

Exit codes (``EXIT_CODES``): 0 done; 1 the daemon refused or failed the
request; 2 bad usage; 3 no daemon answers at the socket; 4 permission
denied (an admin operation, or a socket of another user).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import DaemonUnavailable, PermissionDenied, ReplayError, ReplayTimeout
from .numbaconf import exit_without_teardown
from .version import __version__

EXIT_CODES = {0: "done", 1: "the daemon refused or failed the request", 2: "bad usage",
              3: "no daemon answers at the socket", 4: "permission denied"}


class Admin:
    """A control-socket connection for admin requests (no hello: no channel)."""

    def __init__(self, path: str | None, timeout: float):
        from .client.link import ControlLink
        from .wire.names import client_socket_path
        self.path = client_socket_path(path)
        self.link = ControlLink(self.path, timeout)
        try:
            self.link.admin_hello()
        except BaseException:
            self.link.close()
            raise

    def request(self, op: str, **args) -> dict:
        msg = self.link.request(op, **args)
        msg.pop("id", None)
        msg.pop("ok", None)
        return msg

    def close(self) -> None:
        self.link.close()


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _status(admin: Admin, args) -> int:
    st = admin.request("stats")
    if args.json:
        _print_json(st)
    else:
        from .statusview import render
        print("\n".join(render(st)))
    return 0


def _top(admin: Admin, args) -> int:
    """The status, refreshed every ``--interval`` s until Ctrl-C (or ``--count`` screens)."""
    from .statusview import render
    n = 0
    try:
        while args.count is None or n < args.count:
            st = admin.request("stats")
            if args.json:
                print(json.dumps(st, default=str), flush=True)  # one object per line
            else:
                sys.stdout.write("\033[H\033[2J" if sys.stdout.isatty() else "\n")
                hint = "Ctrl-C ends" if args.count is None else f"screen {n + 1} of {args.count}"
                print("\n".join(render(st)) + f"\n\n(every {args.interval:g} s; {hint})", flush=True)
            n += 1
            if args.count is None or n < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def _shutdown(admin: Admin, args) -> int:
    """Ask the daemon to stop; wait (``--wait`` s) until its socket is gone;
    say what it stopped."""
    st = admin.request("stats")
    admin.request("shutdown")
    admin.close()
    tables = st.get("tables", {})
    items = sum(t["size"] for t in tables.values())
    deadline = time.monotonic() + args.wait
    stopped = False
    while time.monotonic() < deadline:
        if not _running(st["daemon_pid"]):
            stopped = True
            break
        time.sleep(0.05)
    report = {"daemon_pid": st["daemon_pid"], "instance": st["instance"], "stopped": stopped,
              "tables": sorted(tables), "items": items, "clients": st["clients"]}
    if args.json:
        _print_json(report)
    else:
        print(f"shmreplayd pid {st['daemon_pid']} (instance {st['instance']}) "
              f"{'stopped' if stopped else f'asked to stop (still running after {args.wait:g} s)'}: "
              f"{len(tables)} table(s) with {items:,} items ({', '.join(sorted(tables)) or 'none'}), "
              f"{st['clients']} client(s) disconnected")
    return 0 if stopped else 1


def _running(pid: int) -> bool:
    """A process that has not exited (a zombie waiting for its parent has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"


def _cleanup(args) -> int:
    from .server.disk import ownership  # the daemon's own rules; only this command needs them
    reports = ownership.cleanup(dry_run=args.dry_run, keep_tables=args.keep_tables,
                                only=args.instance,
                                storage_dirs=[os.path.abspath(d) for d in args.storage_dir or ()])
    if args.json:
        _print_json([{"instance": r.instance, "owner": r.owner, "unknown": r.unknown,
                      "objects": list(r.objects), "removed": not (r.unknown or r.owner is not None
                                                                  or args.dry_run)} for r in reports])
        return 0
    for r in reports:
        if r.unknown:
            print(f"instance {r.instance}: owner unknown (not a file of this user, or a header of "
                  f"another layout), kept {len(r.objects)} object(s): " + " ".join(r.objects))
        elif r.owner is not None:
            print(f"instance {r.instance}: live daemon pid {r.owner}, kept {len(r.objects)} object(s)")
        else:
            verb = "would remove" if args.dry_run else "removed"
            print(f"instance {r.instance}: owner dead, {verb} {len(r.objects)} object(s): "
                  + " ".join(r.objects))
    if not reports:
        print("no shmreplay objects in /dev/shm")
    return 0


def _simple(admin: Admin, args) -> int:
    """tables, checkpoint, sync, drop: one request, its answer."""
    if args.cmd == "tables":
        out = [d["spec"]["name"] for d in admin.request("list_tables")["tables"]]
        text = "\n".join(out)
    elif args.cmd == "checkpoint":
        out = admin.request("checkpoint", tables=[args.table] if args.table else [],
                            to=os.path.abspath(args.to))["checkpoints"]
        text = "\n".join(f"{r['table']}: {r['items']} items, {r['bytes'] / 2**20:.1f} MiB in "
                         f"{r['write_s']:.2f} s -> {r['path']} (inserts and samples paused "
                         f"{1e3 * r['pause_s']:.2f} ms; {r['dropped']} items evicted during the copy "
                         "left out)" for r in out)
    elif args.cmd == "sync":
        out = admin.request("sync", tables=[args.table] if args.table else [])["syncs"]
        text = "\n".join(f"{r['table']}: {r['items']} items on disk in {r['path']} "
                         f"({r['bytes'] / 2**20:.1f} MiB of metadata, {r['seconds']:.3f} s)" for r in out)
    else:  # drop
        admin.request("drop_table", name=args.table)
        out, text = {"dropped": args.table}, f"{args.table}: dropped"
    if args.json:
        _print_json(out)
    elif text:
        print(text)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shmreplay", description="shmreplay admin tool",
                                 epilog="exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items()),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"shmreplay {__version__}")
    ap.add_argument("--socket", help="daemon socket (default: $SHMREPLAY_SOCKET or the default path)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon (default 10; "
                    "checkpoint and sync: 600)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def command(name, help):
        p = sub.add_parser(name, help=help)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    command("status", "the daemon, each table (rates, limiter, checkpoint age) and each client")
    tp = command("top", "status refreshed every second until Ctrl-C")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between screens")
    tp.add_argument("--count", type=int, default=None, help="stop after this many screens")
    command("tables", "list table names")
    ck = command("checkpoint", "write a checkpoint of one table or all")
    ck.add_argument("table", nargs="?", help="table name (default: every table)")
    ck.add_argument("--to", required=True, metavar="DIR", help="directory (the daemon writes it)")
    sy = command("sync", "write durable file-backed tables' metadata to disk now")
    sy.add_argument("table", nargs="?", help="table name (default: every durable table)")
    cl = command("cleanup", "list and remove shared memory left by dead daemons")
    cl.add_argument("--dry-run", action="store_true", help="only list")
    cl.add_argument("--keep-tables", action="store_true",
                    help="keep table segments (a restarted daemon adopts them)")
    cl.add_argument("--instance", help="only this instance")
    cl.add_argument("--storage-dir", action="append", metavar="DIR",
                    help="also rows files of file-backed tables in DIR whose metadata is gone "
                         "(after a reboot); repeatable")
    dr = command("drop", "drop a table, its data with it (also one set aside)")
    dr.add_argument("table")
    sd = command("shutdown", "stop the daemon cleanly and say what it stopped")
    sd.add_argument("--wait", type=float, default=60.0, help="seconds to wait for it to exit")
    sub.add_parser("bench", help="quick benchmark against the peers installed (< 1 min)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "bench":
        from .bench import runner  # starts its own daemons; needs none running
        report = runner.run(quick=True, log=lambda s: print(s, flush=True))
        print("\n" + runner.table(report))
        return 0
    try:
        if args.cmd == "cleanup":
            return _cleanup(args)
        timeout = 600.0 if args.cmd in ("checkpoint", "sync") else args.timeout
        admin = Admin(args.socket, timeout)
        try:
            handler = {"status": _status, "top": _top, "shutdown": _shutdown}.get(args.cmd, _simple)
            return handler(admin, args)
        finally:
            admin.close()
    except PermissionDenied as exc:
        print(f"shmreplay: {exc}", file=sys.stderr)
        return 4
    except (DaemonUnavailable, ReplayTimeout) as exc:
        print(f"shmreplay: {exc}", file=sys.stderr)
        return 3
    except ReplayError as exc:
        print(f"shmreplay: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    exit_without_teardown(main())  # ~0.2 s less per run: see numbaconf
