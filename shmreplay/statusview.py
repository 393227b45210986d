"""``shmreplay status`` and ``top`` as an operator reads them: a daemon's
``stats`` (one dict, as the control socket returns it) turned into lines.

Pure functions of that dict: no socket, no clock.  Used by ``cli.py``.
"""

from __future__ import annotations


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def _age(s) -> str:
    if s is None:
        return "never"
    s = float(s)
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def _limiter(lim: dict) -> str:
    ins, smp = lim.get("inserts_blocked"), lim.get("samples_blocked")
    wi, ws = lim.get("waiting_inserts", 0), lim.get("waiting_samples", 0)
    state = ("inserts held" if ins else "") + (" + " if ins and smp else "") + ("samples held" if smp else "")
    return f"{state or 'open'}, {wi} ins / {ws} smp waiting"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def details(t: dict) -> list[str]:
    """A table's lines below the grid: where its rows are, its writers'
    and learners' slots, durability and prefetch when it has them."""
    where = "file" if t["file_backed"] else "shared memory"
    out = [f"rows: {t['rows_bytes'] / 2**30:.2f} GiB in {where} {t['rows']}"
           + (f", {t['resident_bytes'] / 2**30:.2f} GiB of it in memory" if t.get("resident_bytes") is not None
              else "")
           + f"; {t['reserved']} reserved, {t['held']} held, {t['evictions']:,} evicted, "
           f"{t['stale_priority_updates']:,} stale updates"]
    if t.get("frames"):  # a frame table: its rings, and what a transition costs it
        f = t["frames"]
        rings = ", ".join(f"{b} {r['held']:,}/{r['frames']:,} frames held"
                          + (f" ({r['frames_per_item']} an item)" if r["frames_per_item"] is not None else "")
                          for b, r in f["rings"].items())
        out.append(f"frames: {rings}; {f['in_leases']:,} in {f['leases']} writers' frame leases, "
                   f"{f['evicted_for_frames']:,} items evicted for frames; "
                   f"{t['bytes_per_item']:,.0f} bytes a transition, full")
    if t.get("durable"):
        age = t["last_sync_age_s"]
        out.append(f"durable: {t['synced_items']} items on disk in {t['meta_file']}, synced "
                   f"{'never' if age is None else f'{age:.1f} s ago'} ({t['syncs']} syncs, "
                   f"{t['sync_failures']} failed); {t['retired']} slots wait for the next sync "
                   f"(headroom {t['sync_headroom']})")
    if t.get("sync_error"):  # the disk is full, or failing: backing off
        out.append(f"SYNC FAILING: {t['sync_error']}")
    if "prefetch_reads" in t:
        out.append(f"prefetch: {t['prefetch_reads']} reads ({t['prefetch_bytes'] / 2**30:.2f} GiB), "
                   f"{t['prefetch_dropped']} dropped, {t['prefetch_errors']} failed; "
                   f"{t['writeback_calls']} writebacks started")
    for h in t.get("holders", []):  # a learner that hangs keeps these until the daemon's hold_timeout_s
        out.append(f"client {h['client']}, pid {h['pid']}: {h['held']} slots held, oldest {h['oldest_s']:.1f} s")
    if t.get("other_holders"):  # a user who may not administer sees others' only as a count
        out.append(f"{t['other_holders']} clients of other users hold slots")
    for why in (t["limiter"].get("inserts_blocked"), t["limiter"].get("samples_blocked")):
        if why:
            out.append(f"limiter: {why}")
    return out


def render(st: dict) -> list[str]:
    """The status screen: a daemon line, a table per table, a line per client."""
    mem = st.get("memory", {})
    lines = [f"shmreplayd {st.get('version', '?')}  pid {st['daemon_pid']}  instance {st['instance']}  "
             f"up {_uptime(st['uptime_s'])}  memory {_mib(mem.get('rss_bytes', 0))} MiB "
             f"(peak {_mib(mem.get('peak_rss_bytes', 0))})"
             + (f"  cpu {st['cpu']['percent']:.0f}% ({st['cpu']['seconds']:,.1f} s)" if "cpu" in st else "")
             + f"  clients {st['clients']}",
             f"socket {st['socket']}" + (f"  metrics {st['metrics']}" if st.get("metrics") else "")]
    tables = st.get("tables", {})
    if tables:
        rows = [["TABLE", "ITEMS", "CAPACITY", "MiB", "RESIDENT", "SAMPLER/REMOVER", "INSERTS/s", "SAMPLES/s",
                 "BATCHES/s", "LIMITER", "CHECKPOINT"]]
        for name, t in sorted(tables.items()):
            res = t.get("resident_bytes")
            rows.append([name, f"{t['size']:,}", f"{t['capacity']:,}", _mib(t["rows_bytes"]),
                         "-" if res is None else _mib(res), f"{t['sampler']}/{t['remover']}",
                         f"{t.get('inserts_per_s', 0):,.0f}", f"{t.get('samples_per_s', 0):,.0f}",
                         f"{t.get('batches_per_s', 0):,.1f}", _limiter(t["limiter"]),
                         _age(t.get("last_checkpoint_age_s"))])
        lines += [""] + _table(rows, right={1, 2, 3, 4, 6, 7, 8})
        for name, t in sorted(tables.items()):
            lines += [f"  {name}: {line}" for line in details(t)]
    else:
        lines += ["", "no tables"]
    for name, a in st.get("set_aside", {}).items():
        lines.append(f"  {name}: SET ASIDE, data kept in {', '.join(a['objects']) or 'no objects'}: {a['reason']}")
    clients = st.get("client_list", [])
    if st.get("other_clients"):
        lines += ["", f"{st['other_clients']} clients of other users (an admin sees who)"]
    if clients:
        rows = [["CLIENT", "PID", "UID", "TABLES"]]
        for c in clients:
            rows.append([str(c["client"]), str(c["pid"]), "?" if c.get("uid") is None else str(c["uid"]),
                         ", ".join(f"{t} ({r})" for t, r in c["tables"].items()) or "-"])
        lines += [""] + _table(rows, right={1, 2})
    return lines
