"""What the daemon does for each control op: one handler per op of
``wire.control.REQUESTS`` (which checked the message's fields), and the
admin check before any of them.

Stateless: each handler takes the ``ControlConnection`` (connection.py)
that received the message and the message, and returns the reply's fields.
Table work goes to the tables' life cycle (lifecycle.py), the rest to the
``ControlServer`` (server.py); descriptors a reply carries go to the
connection's handshake (handshake.py).

Event-loop thread only, from a connection's request task (``dispatch``),
one request of a connection at a time; requests of different connections
overlap at their awaits.
"""

from __future__ import annotations

import logging
import os

from ...errors import CapacityError, PermissionDenied, ProtocolError
from ...schema import check_table_name
from ...wire.control import ADMIN_OPS
from . import access

log = logging.getLogger("shmreplayd.control")


async def dispatch(conn, msg: dict) -> dict | None:
    """Answer ``msg``: the reply's fields (None: none), or raise."""
    op = msg["op"]
    if op in ADMIN_OPS and not access.may_administer(conn.srv.cfg, conn.peer):
        raise PermissionDenied(f"{op} is an admin operation: only the daemon's user, root or "
                               f"the admin_group may run it (you are uid {conn.peer.uid})")
    handler = HANDLERS.get(op)
    if handler is None:
        raise ProtocolError(f"op {op!r} has no handler")
    return await handler(conn, msg)


async def on_hello(conn, msg: dict) -> dict:
    return conn.handshake.hello(msg)


async def on_ready(conn, msg: dict) -> None:
    await conn.attach()


async def on_create_table(conn, msg: dict) -> dict:
    return await with_rows(conn, await conn.srv.tables.create(msg["spec"], msg["exist_ok"], conn.peer))


async def on_open_table(conn, msg: dict) -> dict:
    return await with_rows(conn, await conn.srv.tables.open(check_table_name(msg["name"])))


async def on_drop_table(conn, msg: dict) -> None:
    await conn.srv.tables.drop(msg["name"])


async def on_list_tables(conn, msg: dict) -> dict:
    return {"tables": await conn.srv.call(conn.srv.engine.describe)}


async def on_status(conn, msg: dict) -> dict:
    return await conn.srv.status(conn.peer)  # another user's clients: counts only (seen.py)


async def on_checkpoint(conn, msg: dict) -> dict:
    return {"checkpoints": await conn.srv.checkpoints.write(_names(msg, "checkpoint"), msg["to"])}


async def on_sync(conn, msg: dict) -> dict:
    return {"syncs": await conn.srv.tables.sync(_names(msg, "sync"))}


async def on_shutdown(conn, msg: dict) -> None:
    log.info("shutdown requested by pid %d (uid %d)", conn.peer.pid, conn.peer.uid)
    conn.srv.request_shutdown()


# every op of wire.control.REQUESTS
HANDLERS = {"hello": on_hello, "ready": on_ready, "create_table": on_create_table,
            "open_table": on_open_table, "drop_table": on_drop_table,
            "list_tables": on_list_tables, "stats": on_status, "status": on_status,
            "checkpoint": on_checkpoint, "sync": on_sync, "shutdown": on_shutdown}


async def with_rows(conn, desc: dict) -> dict:
    """The reply to a create or open.  A table only its creator writes
    (``writers="creator"``) has rows the group may only read: its
    creator, or an admin, who is not the daemon's user gets a writable
    descriptor of them with the reply (SCM_RIGHTS), so no name of them
    is writable by anyone else.  A new open file description (reopened
    through /proc), so nothing the client sets on it (``fcntl``) reaches
    the daemon's own."""
    uid = desc["spec"].get("writer_uid")
    if uid is None or access.is_owner(conn.peer.uid) or not (
            uid == conn.peer.uid or access.may_administer(conn.srv.cfg, conn.peer)):
        return {"table": desc}
    table = await conn.srv.call(conn.srv.engine.table_named, desc["spec"]["name"])
    try:
        fd = os.open(f"/proc/self/fd/{table.map.rows.fd}", os.O_RDWR | os.O_CLOEXEC)
    except (OSError, TypeError) as exc:  # out of descriptors; the table dropped meanwhile
        raise CapacityError(f"the daemon cannot pass the rows of table {desc['spec']['name']!r} "
                            f"now ({exc}); try again") from None
    conn.handshake.carry(fd)
    return {"table": desc, "fds": ["rows"]}


def _names(msg: dict, op: str) -> list:
    if not all(isinstance(n, str) for n in msg["tables"]):
        raise ProtocolError(f"{op}: 'tables' must be a list of names")
    return msg["tables"]
