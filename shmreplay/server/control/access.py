"""Who may connect, and who may run admin operations.

The kernel tells the daemon who is on the other end of each control
connection (``SO_PEERCRED``: pid, uid, gid; ``SO_PEERGROUPS``: the
supplementary groups, Linux >= 4.13), so no client can claim to be someone
else.  The rules (config keys in ``[daemon]``):

* connect: root, the daemon's own user, a user in ``allowed_users``, or a
  member (primary or supplementary) of a group in ``allowed_groups``;
* admin operations (``protocol.ADMIN_OPS``: drop_table, checkpoint,
  shutdown): root, the daemon's own user, or a member of ``admin_group``;
* writing a table made with ``writers="creator"`` (a ParameterBoard): its
  creator (``writer_uid``, recorded here at create) and the admins above
  (the engine enforces it: ``engine/commands.py``).

The file modes back this up: the socket and every segment are mode
``segment_mode`` (0660) and owned by the config's ``group``, so a user the
rules let in must also be in that group to map the tables.  A client's
channel is given to that client's uid when the daemon runs as root.

Pure functions; the control plane calls them per connection (gate.py) and
per table (quotas.py), the metrics process per connection to its Unix
socket (scrapes.py: ``may_connect`` reads only ``allowed_uids`` and
``allowed_gids`` of what it is given).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...schema import TableSpec
from ...wire import peer

if TYPE_CHECKING:  # the metrics process (scrapes.py) uses the rules without the config's imports (numba)
    from .config import DaemonConfig


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset


def peer_of(sock) -> Peer:
    """The kernel's record of who connected ``sock`` (a Unix stream socket)."""
    pid, uid, gid = peer.credentials(sock)
    groups = {gid}
    try:
        groups.update(peer.groups(sock))
    except OSError:
        groups.update(_proc_groups(pid))  # older kernels: racy but close enough
    return Peer(pid, uid, gid, frozenset(groups))


def _proc_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def is_owner(uid: int) -> bool:
    """Root or the daemon's own user: they run the daemon (and are exempt
    from the per-user limits of quotas.py)."""
    return uid == 0 or uid == os.geteuid()


def may_connect(cfg: DaemonConfig, peer: Peer) -> bool:
    return is_owner(peer.uid) or peer.uid in cfg.allowed_uids or bool(peer.groups & cfg.allowed_gids)


def may_administer(cfg: DaemonConfig, peer: Peer) -> bool:
    return is_owner(peer.uid) or (cfg.admin_gid is not None and cfg.admin_gid in peer.groups)


def writer_of(spec: TableSpec, peer: Peer | None, cfg: DaemonConfig | None = None,
              have: TableSpec | None = None) -> TableSpec:
    """``spec`` as ``peer`` (None: the daemon) asks to create it, with its
    creator (``creator_uid``, when not root or the daemon's user) and its
    writer recorded: the kernel's word on the creator, whatever the client
    sent.  ``have``: the table of that name already served, whose writer an
    admin's ``exist_ok`` create keeps (an admin may write it too)."""
    uid = os.geteuid() if peer is None else peer.uid
    # the creator, kept with the table when it is another user (quotas.py)
    spec = dataclasses.replace(spec, creator_uid=None if is_owner(uid) else uid)
    if not spec.writer_only:
        return spec
    if have is not None and have.writer_only and (peer is None or may_administer(cfg, peer)):
        return dataclasses.replace(spec, writer_uid=have.writer_uid)
    return dataclasses.replace(spec, writer_uid=uid)
