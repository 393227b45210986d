"""What ``status`` (and ``stats``) shows to whom.

Root, the daemon's user and the admin group (``access.may_administer``)
see everything: every client's pid and uid, every holder, every creator.
Anyone else the daemon lets connect sees its own clients in full and other
users' only as counts: which processes of other users use the daemon, and
as whom, is theirs to know (``ps`` shows a process to everyone, not what it
connects to).  Tables, their numbers and the daemon's own state are every
client's: they share the tables.  docs/protocol.md lists the fields, and
docs/reliability.md section 12 the rule.

Pure function; the event loop calls it per status request.
"""

from __future__ import annotations


def for_user(st: dict, uid: int) -> dict:
    """``st`` (a full status) as user ``uid`` may see it.  Fields that
    name another user's client become counts: ``other_clients``, and per
    table ``other_holders`` (clients of others holding slots) and
    ``orphan_holders`` as a count; ``creators`` keeps ``uid``'s own entry and
    sums the rest as ``others``."""
    mine = [c for c in st.get("client_list", []) if c.get("uid") == uid]
    own = {c["client"] for c in mine}
    out = {**st, "client_list": mine, "other_clients": len(st.get("client_list", [])) - len(mine)}
    tables = {}
    for name, t in st.get("tables", {}).items():
        holders = t.get("holders", [])
        tables[name] = {**t, "holders": [h for h in holders if h["client"] in own],
                        "other_holders": sum(h["client"] not in own for h in holders),
                        "orphan_holders": len(t.get("orphan_holders", []))}
    out["tables"] = tables
    creators = st.get("creators", {})
    others = [v for k, v in creators.items() if k != str(uid)]
    out["creators"] = {k: v for k, v in creators.items() if k == str(uid)}
    if others:
        out["creators"]["others"] = {"users": len(others), "tables": sum(v["tables"] for v in others),
                                     "file_bytes": sum(v["file_bytes"] for v in others)}
    return out
