"""``shmreplay``: the admin command line (status, tables)."""

from __future__ import annotations

import argparse
import json
import sys

from .client import connect
from .errors import ReplayError


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
              f"{t['reserved']} reserved, {t['stale_priority_updates']} stale updates")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="shmreplay", description="shmreplay admin tool")
    ap.add_argument("--socket", help="daemon socket (default: $SHMREPLAY_SOCKET or the default path)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="daemon and table status")
    st.add_argument("--json", action="store_true")
    sub.add_parser("tables", help="list table names")
    sub.add_parser("bench", help="quick benchmark against the peers installed (< 1 min)")
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        from .bench import runner  # starts its own daemons; needs none running
        report = runner.run(quick=True, log=lambda s: print(s, flush=True))
        print("\n" + runner.table(report))
        return 0
    try:
        with connect(args.socket, timeout=10.0) as client:
            if args.cmd == "status":
                _status(client, args)
            elif args.cmd == "tables":
                print("\n".join(client.list_tables()))
    except ReplayError as exc:
        print(f"shmreplay: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
