"""``shmreplay``: the admin command line (status, tables, checkpoint, sync,
drop, cleanup, shutdown, bench).  A tool at the package root: it talks to a daemon
as a client, and ``cleanup`` uses the daemon's own ownership rules.  Runs
in its own process, one thread."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .client import connect
from .errors import ReplayError
from .numbaconf import exit_without_teardown
from .server.disk import ownership


def _status(client, args) -> None:
    st = client.stats()
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return
    print(f"daemon pid {st['daemon_pid']}  protocol {st['protocol']}  instance {st['instance']}  "
          f"socket {st['socket']}  up {st['uptime_s']:.0f} s  clients {st['clients']}")
    eng = st["engine"]
    print(f"engine: {eng['commands']} commands, {eng['sleeps']} sleeps, {eng['disconnects']} disconnects")
    for name, t in st["tables"].items():
        print(f"table {name}: {t['size']}/{t['capacity']} items ({t['sampler']}), "
              f"{t['inserts']} inserted, {t['samples']} sampled, {t['evictions']} evicted, "
              f"{t['reserved']} reserved, {t['held']} held, {t['stale_priority_updates']} stale updates")
        print(f"  rows: {t['rows_bytes'] / 2**30:.2f} GiB in {'file' if t['file_backed'] else 'shared memory'}"
              f" {t['rows']}" + (f", {t['resident_bytes'] / 2**30:.2f} GiB of it in memory"
                                 if t.get("resident_bytes") is not None else ""))
        if t.get("durable"):
            age = t["last_sync_age_s"]
            print(f"  durable: {t['synced_items']} items on disk in {t['meta_file']}, synced "
                  f"{'never' if age is None else f'{age:.1f} s ago'} ({t['syncs']} syncs, "
                  f"{t['sync_failures']} failed); {t['retired']} slots wait for the next sync "
                  f"(headroom {t['sync_headroom']})")
            if t.get("sync_error"):  # the disk is full, or failing: backing off
                print(f"  SYNC FAILING: {t['sync_error']}")
        if "prefetch_reads" in t:  # a file-backed table with the daemon's prefetch on
            print(f"  prefetch: {t['prefetch_reads']} reads ({t['prefetch_bytes'] / 2**30:.2f} GiB), "
                  f"{t['prefetch_dropped']} dropped, {t['prefetch_errors']} failed; "
                  f"{t['writeback_calls']} writebacks started")
        for h in t["holders"]:  # a learner that hangs keeps these until the daemon's hold_timeout_s
            print(f"  client {h['client']}, pid {h['pid']}: {h['held']} slots held, "
                  f"oldest {h['oldest_s']:.1f} s")
    for name, a in st.get("set_aside", {}).items():  # kept, not served: the operator's to fix or drop
        print(f"table {name}: SET ASIDE, data kept in {', '.join(a['objects']) or 'no objects'}: "
              f"{a['reason']}")


def _cleanup(args) -> int:
    reports = ownership.cleanup(dry_run=args.dry_run, keep_tables=args.keep_tables,
                                only=args.instance,
                                storage_dirs=[os.path.abspath(d) for d in args.storage_dir or ()])
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="shmreplay", description="shmreplay admin tool")
    ap.add_argument("--socket", help="daemon socket (default: $SHMREPLAY_SOCKET or the default path)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="daemon and table status")
    st.add_argument("--json", action="store_true")
    sub.add_parser("tables", help="list table names")
    ck = sub.add_parser("checkpoint", help="write a checkpoint of one table or all")
    ck.add_argument("table", nargs="?", help="table name (default: every table)")
    ck.add_argument("--to", required=True, metavar="DIR", help="directory (the daemon writes it)")
    sy = sub.add_parser("sync", help="write durable file-backed tables' metadata to disk now")
    sy.add_argument("table", nargs="?", help="table name (default: every durable table)")
    cl = sub.add_parser("cleanup", help="list and remove shared memory left by dead daemons")
    cl.add_argument("--dry-run", action="store_true", help="only list")
    cl.add_argument("--keep-tables", action="store_true",
                    help="keep table segments (a restarted daemon adopts them)")
    cl.add_argument("--instance", help="only this instance")
    cl.add_argument("--storage-dir", action="append", metavar="DIR",
                    help="also rows files of file-backed tables in DIR whose metadata is gone "
                         "(after a reboot); repeatable")
    dr = sub.add_parser("drop", help="drop a table, its data with it (also one set aside)")
    dr.add_argument("table")
    sub.add_parser("shutdown", help="stop the daemon cleanly")
    sub.add_parser("bench", help="quick benchmark against the peers installed (< 1 min)")
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        from .bench import runner  # starts its own daemons; needs none running
        report = runner.run(quick=True, log=lambda s: print(s, flush=True))
        print("\n" + runner.table(report))
        return 0
    if args.cmd == "cleanup":
        return _cleanup(args)
    try:
        with connect(args.socket, timeout=600.0 if args.cmd in ("checkpoint", "sync") else 10.0) as client:
            if args.cmd == "status":
                _status(client, args)
            elif args.cmd == "tables":
                print("\n".join(client.list_tables()))
            elif args.cmd == "checkpoint":
                for r in client.checkpoint(os.path.abspath(args.to), args.table):
                    print(f"{r['table']}: {r['items']} items, {r['bytes'] / 2**20:.1f} MiB in "
                          f"{r['write_s']:.2f} s -> {r['path']} (inserts and samples paused "
                          f"{1e3 * r['pause_s']:.2f} ms; {r['dropped']} items evicted during the copy "
                          "left out)")
            elif args.cmd == "sync":
                for r in client.sync(args.table):
                    print(f"{r['table']}: {r['items']} items on disk in {r['path']} "
                          f"({r['bytes'] / 2**20:.1f} MiB of metadata, {r['seconds']:.3f} s)")
            elif args.cmd == "drop":
                client.drop_table(args.table)
                print(f"{args.table}: dropped")
            elif args.cmd == "shutdown":
                client.shutdown()
    except ReplayError as exc:
        print(f"shmreplay: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())  # ~0.2 s less per run: see numbaconf
