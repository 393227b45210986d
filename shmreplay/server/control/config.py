"""Daemon configuration: the TOML file (daemon/shmreplayd.toml documents every key).

Read once at startup by the daemon's main thread; a ``DaemonConfig`` is not
changed afterwards.  Object names and the socket path come from
``wire.names``, which clients share.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import dataclasses
from dataclasses import dataclass, field

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ...errors import PermissionDenied, SchemaError
from ...schema import TableSpec, spec_from_dict
from ...wire import names
from ..disk.prefetch import METHODS as PREFETCH_METHODS
from ..tables.slots.ledger import SlotLimits

_INSTANCE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


@dataclass
class DaemonConfig:
    """Every [daemon] key, its default the field's: ``parse_config`` starts from
    ``DaemonConfig()`` and reads each key over it.  A key named otherwise in
    the file than here (a name there, an id here) says so in ``metadata``."""
    socket: str = ""
    instance: str = "default"
    segment_mode: int = 0o660
    spin_us: float = 250.0
    learner_spin_us: float = 2000.0
    learner_spin_max_us: float = 10000.0  # stays up for slower learners while the spin costs nobody a core
    idle_timeout_s: float = 1.0
    metrics_address: str = "127.0.0.1"  # Prometheus /metrics (control/metrics.py)
    metrics_port: int | None = None     # None: off; 0: any free port (logged, and in status)
    metrics_socket: str = ""            # a Unix socket for /metrics, readable as the control socket is
    metrics_tcp_tables: bool = True     # per-table metrics on the TCP endpoint too (any local user reads it)
    log_level: str = "info"
    seed: int | None = None  # seeds every table's sampler (seed + table id): reproducible runs
    # recovery and checkpoints (docs/reliability.md)
    retain_tables: bool = False       # leave table segments at shutdown for the next daemon
    hold_timeout_s: float = 5.0       # longest a learner may keep slots of its last samples
    reservation_timeout_s: float = 60.0  # a writer's reservation not committed by then is void
    checkpoint_dir: str = ""          # periodic checkpoints go here; restored at start
    checkpoint_interval_s: float = 0.0  # 0: no periodic checkpoints
    checkpoint_keep: int = 2
    checkpoint_buffer_mb: float = 1024.0  # rows gathered ahead of the disk (disk/checkpoint.py)
    # access control: the socket and every segment are owned by ``gid`` with
    # segment_mode; connections are checked with SO_PEERCRED (server.py)
    gid: int = field(default=-1, metadata={"key": "group"})  # -1: the daemon's own group (chown's "unchanged")
    allowed_uids: set = field(default_factory=set, metadata={"key": "allowed_users"})
    allowed_gids: set = field(default_factory=set, metadata={"key": "allowed_groups"})
    admin_gid: int | None = field(default=None, metadata={"key": "admin_group"})
    max_clients: int = 256
    max_clients_per_user: int = 128   # one user cannot take every connection
    handshake_timeout_s: float = 10.0  # a connection that sends no hello by then is closed
    max_tables: int = 64
    # file-backed tables (wire/rowfile.py): the default directory of every
    # table's rows ("": /dev/shm), and the only directories a table's rows
    # may be put in (this one, storage_dirs, and those of [[tables]])
    storage_dir: str = ""
    storage_dirs: set = field(default_factory=set)
    # a file-backed table's metadata is synced to a file beside its rows
    # (disk/durable.py) every sync_interval_s (0: only when a full table needs
    # its retired slots, at a clean stop and on `shmreplay sync`), so it
    # survives a reboot; off: it lives and dies with /dev/shm like the rest
    durable_file_tables: bool = True
    sync_interval_s: float = 10.0
    # their prefetch (server/disk/prefetch.py): reader threads (0: none), the most
    # byte ranges queued for them, "fadvise" (WILLNEED) or "pread"
    prefetch_threads: int = 16
    prefetch_queue: int = 4096
    prefetch_method: str = "fadvise"
    # per-user limits: what one user other than the daemon's own and root may
    # take (quotas.py); refused connections kept open to deliver their reason
    # (gate.py); descriptors kept for root, the daemon's user and the admin
    # group (descriptors.py).  daemon/shmreplayd.toml says why each default.
    max_tables_per_user: int = 16
    reserved_tables: int = 4          # other users together: at most max_tables - this (max_tables // 16)
    file_quota_bytes_per_user: int | None = None  # one user's rows files; None: a share of each filesystem (quotas.py); 0: none
    max_lingering_refusals: int = 16
    max_lingering_refusals_per_user: int = 4
    refusal_linger_s: float = 10.0
    reserved_descriptors: int = 64
    reserved_clients: int = 16        # other users together: at most max_clients - this (max_clients // 16)
    tables: list[TableSpec] = field(default_factory=list, metadata={"key": None})  # [[tables]], not [daemon]

    def slot_limits(self) -> SlotLimits:
        """How long a table's slots may stay out of use (holds, reservations)."""
        return SlotLimits(self.hold_timeout_s, self.reservation_timeout_s)

    def place(self, spec: TableSpec) -> TableSpec:
        """``spec`` with its rows directory decided: None takes the default,
        "" means /dev/shm.  A directory the config does not allow is refused:
        a client may not make the daemon create files anywhere it can write.
        Every table a request or the config asks for comes through here."""
        d = self.storage_dir if spec.storage_dir is None else spec.storage_dir
        if d and d not in self.storage_dirs:
            raise PermissionDenied(
                f"table {spec.name!r}: storage_dir {d} is not one the daemon's config allows "
                f"({', '.join(sorted(self.storage_dirs)) or 'none: set storage_dir or storage_dirs'})")
        return dataclasses.replace(spec, storage_dir=d or None)

    def socket_path(self, override: str | None = None) -> str:
        path = override or self.socket or os.environ.get(names.ENV_SOCKET) or names.default_socket_path()
        if len(os.fsencode(path)) > names.SOCKET_PATH_MAX:
            # bind() would fail with a bare "AF_UNIX path too long"
            raise SchemaError(f"socket {path!r} is {len(os.fsencode(path))} bytes long; a Unix socket's "
                              f"path may have at most {names.SOCKET_PATH_MAX}: choose a shorter socket path "
                              "(--socket, socket in [daemon], or $SHMREPLAY_SOCKET)")
        return path


# the [daemon] keys, as the file names them
DAEMON_KEYS = frozenset(f.metadata.get("key", f.name) for f in dataclasses.fields(DaemonConfig)) - {None}


def check_instance(name: str) -> str:
    if not _INSTANCE.match(name):
        raise SchemaError(f"instance {name!r} must match {_INSTANCE.pattern}")
    return name


def load_config(path: str | None) -> DaemonConfig:
    if path is None:
        return DaemonConfig()
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SchemaError(f"cannot read config {path}: {exc}") from exc
    return parse_config(doc, path)


def parse_config(doc: dict, where: str = "config") -> DaemonConfig:
    unknown = set(doc) - {"daemon", "tables"}
    if unknown:
        raise SchemaError(f"{where}: unknown sections {sorted(unknown)}")
    d = doc.get("daemon", {})
    unknown = set(d) - DAEMON_KEYS
    if unknown:
        raise SchemaError(f"{where}: unknown [daemon] keys {sorted(unknown)}")
    cfg = DaemonConfig()
    cfg.socket = str(d.get("socket", cfg.socket))
    cfg.instance = check_instance(str(d.get("instance", cfg.instance)))
    mode = d.get("segment_mode", cfg.segment_mode)
    try:
        cfg.segment_mode = int(mode, 8) if isinstance(mode, str) else int(mode)
    except ValueError as exc:
        raise SchemaError(f"{where}: segment_mode {mode!r} is not an octal mode") from exc
    cfg.spin_us = _number(d, "spin_us", cfg.spin_us, where, lo=0.0)
    cfg.learner_spin_us = _number(d, "learner_spin_us", cfg.learner_spin_us, where, lo=0.0)
    cfg.learner_spin_max_us = _number(d, "learner_spin_max_us", cfg.learner_spin_max_us, where, lo=0.0)
    # the longest an idle engine sleeps: a lazy commit is applied by then at
    # the latest, so it must be a finite time (a negative one made epoll wait
    # for ever)
    cfg.idle_timeout_s = _number(d, "idle_timeout_s", cfg.idle_timeout_s, where, lo=0.001, hi=3600.0)
    address = d.get("metrics_address", cfg.metrics_address)
    if not isinstance(address, str) or not address.strip():
        # str() of a number or a list would bind somewhere nobody asked for
        raise SchemaError(f"{where}: metrics_address must be a string, the address to serve "
                          f"metrics on (default \"127.0.0.1\"; \"0.0.0.0\" for every address), "
                          f"got {address!r}")
    cfg.metrics_address = address
    if "metrics_port" in d:
        port = d["metrics_port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise SchemaError(f"{where}: metrics_port must be an int in 0..65535 (0: any free port), "
                              f"got {port!r}")
        cfg.metrics_port = port
    cfg.metrics_socket = _metrics_socket(d, cfg.metrics_socket, where)
    cfg.metrics_tcp_tables = _bool(d, "metrics_tcp_tables", cfg.metrics_tcp_tables, where)
    cfg.log_level = str(d.get("log_level", cfg.log_level))
    if "seed" in d:
        if not isinstance(d["seed"], int) or d["seed"] < 0:
            raise SchemaError(f"{where}: seed must be an int >= 0, got {d['seed']!r}")
        cfg.seed = d["seed"]
    cfg.retain_tables = _bool(d, "retain_tables", cfg.retain_tables, where)
    # 0 would free held slots before any learner could copy their rows
    cfg.hold_timeout_s = _number(d, "hold_timeout_s", cfg.hold_timeout_s, where, lo=0.001)
    cfg.reservation_timeout_s = _number(d, "reservation_timeout_s", cfg.reservation_timeout_s, where, lo=0.001)
    cfg.checkpoint_dir = str(d.get("checkpoint_dir", cfg.checkpoint_dir))
    if cfg.checkpoint_dir and not os.path.isabs(cfg.checkpoint_dir):
        raise SchemaError(f"{where}: checkpoint_dir must be an absolute path, got {cfg.checkpoint_dir!r}")
    cfg.checkpoint_interval_s = _number(d, "checkpoint_interval_s", cfg.checkpoint_interval_s, where)
    if cfg.checkpoint_interval_s and not cfg.checkpoint_dir:
        raise SchemaError(f"{where}: checkpoint_interval_s needs checkpoint_dir")
    cfg.checkpoint_keep = int(_number(d, "checkpoint_keep", cfg.checkpoint_keep, where, lo=1))
    cfg.checkpoint_buffer_mb = _number(d, "checkpoint_buffer_mb", cfg.checkpoint_buffer_mb, where)
    cfg.max_clients = int(_number(d, "max_clients", cfg.max_clients, where, lo=1))
    cfg.max_clients_per_user = int(_number(d, "max_clients_per_user", cfg.max_clients_per_user, where, lo=1))
    cfg.handshake_timeout_s = _number(d, "handshake_timeout_s", cfg.handshake_timeout_s, where, lo=0.01)
    cfg.max_tables = int(_number(d, "max_tables", cfg.max_tables, where, lo=1))
    if d.get("group", ""):
        cfg.gid = group_id(d["group"], where)
    cfg.allowed_uids = {user_id(u, where) for u in _list(d, "allowed_users", where)}
    cfg.allowed_gids = {group_id(g, where) for g in _list(d, "allowed_groups", where)}
    if d.get("admin_group", ""):
        cfg.admin_gid = group_id(d["admin_group"], where)
    cfg.storage_dir = _abs_dir(d.get("storage_dir", cfg.storage_dir), "storage_dir", where)
    cfg.storage_dirs = {_abs_dir(p, "storage_dirs", where) for p in _list(d, "storage_dirs", where)}
    cfg.storage_dirs |= {cfg.storage_dir} - {""}
    cfg.durable_file_tables = _bool(d, "durable_file_tables", cfg.durable_file_tables, where)
    cfg.sync_interval_s = _number(d, "sync_interval_s", cfg.sync_interval_s, where)
    cfg.prefetch_threads = int(_number(d, "prefetch_threads", cfg.prefetch_threads, where))
    cfg.prefetch_queue = int(_number(d, "prefetch_queue", cfg.prefetch_queue, where, lo=1))
    cfg.prefetch_method = str(d.get("prefetch_method", cfg.prefetch_method))
    if cfg.prefetch_method not in PREFETCH_METHODS:
        raise SchemaError(f"{where}: prefetch_method must be one of {', '.join(PREFETCH_METHODS)}, "
                          f"got {cfg.prefetch_method!r}")
    _user_limits(cfg, d, where)
    names = set()
    for i, t in enumerate(doc.get("tables", [])):
        if not isinstance(t, dict):
            raise SchemaError(f"{where}: tables[{i}] is not a table")
        spec = spec_from_dict(t, f"{where}: tables[{i}]")
        if spec.storage_dir:  # the config's author may put a table anywhere
            cfg.storage_dirs.add(spec.storage_dir)
        spec = cfg.place(spec)
        if spec.writer_only and spec.writer_uid is None:  # the config's tables are the daemon's user's
            spec = dataclasses.replace(spec, writer_uid=os.geteuid())
        if spec.name in names:
            raise SchemaError(f"{where}: table {spec.name!r} is declared twice")
        names.add(spec.name)
        cfg.tables.append(spec)
    return cfg


def _user_limits(cfg: DaemonConfig, d: dict, where: str) -> None:
    cfg.max_tables_per_user = int(_number(d, "max_tables_per_user", cfg.max_tables_per_user, where, lo=1))
    # default: a sixteenth of max_tables (4 of the default 64), at least one
    cfg.reserved_tables = int(_number(d, "reserved_tables", max(1, cfg.max_tables // 16), where, lo=1))
    if cfg.reserved_tables > cfg.max_tables:  # 1 or more: the daemon's user can always create one
        raise SchemaError(f"{where}: reserved_tables ({cfg.reserved_tables}) may not exceed max_tables "
                          f"({cfg.max_tables}); it is the part of max_tables kept for the daemon's user")
    if "file_quota_bytes_per_user" in d:  # unset: the default share (quotas.py)
        cfg.file_quota_bytes_per_user = int(_number(d, "file_quota_bytes_per_user", 0, where))
    cfg.max_lingering_refusals = int(_number(d, "max_lingering_refusals", cfg.max_lingering_refusals, where))
    cfg.max_lingering_refusals_per_user = int(_number(d, "max_lingering_refusals_per_user", cfg.max_lingering_refusals_per_user, where))
    cfg.refusal_linger_s = _number(d, "refusal_linger_s", cfg.refusal_linger_s, where)
    cfg.reserved_descriptors = int(_number(d, "reserved_descriptors", cfg.reserved_descriptors, where))
    cfg.reserved_clients = int(_number(d, "reserved_clients", max(1, cfg.max_clients // 16), where, lo=1))
    if cfg.reserved_clients > cfg.max_clients:  # 1 or more: root and the daemon's user can always connect
        raise SchemaError(f"{where}: reserved_clients ({cfg.reserved_clients}) may not exceed max_clients "
                          f"({cfg.max_clients}); it is the part of max_clients kept for root, the "
                          "daemon's user and the admin group")


def _abs_dir(p, key: str, where: str) -> str:
    if not isinstance(p, str) or (p and not os.path.isabs(p)):
        raise SchemaError(f"{where}: {key} must hold absolute paths, got {p!r}")
    return p.rstrip("/") or ("/" if p else "")


def _bool(d: dict, key: str, default: bool, where: str) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise SchemaError(f"{where}: {key} must be true or false, got {v!r}")
    return v


def _number(d: dict, key: str, default: float, where: str, lo: float = 0.0,
            hi: float | None = None) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo or (hi is not None and not v <= hi):
        bounds = f">= {lo:g}" if hi is None else f"in {lo:g}..{hi:g}"
        raise SchemaError(f"{where}: {key} must be a number {bounds}, got {v!r}")
    return float(v)


def _list(d: dict, key: str, where: str) -> list:
    v = d.get(key, [])
    if not isinstance(v, list):
        raise SchemaError(f"{where}: {key} must be a list of names or ids, got {v!r}")
    return v


def user_id(u, where: str = "config") -> int:
    """A user name or uid -> uid (the user must exist)."""
    try:
        return pwd.getpwuid(u).pw_uid if isinstance(u, int) else pwd.getpwnam(str(u)).pw_uid
    except KeyError:
        raise SchemaError(f"{where}: no user {u!r} on this machine") from None


def group_id(g, where: str = "config") -> int:
    """A group name or gid -> gid (the group must exist)."""
    try:
        return grp.getgrgid(g).gr_gid if isinstance(g, int) else grp.getgrnam(str(g)).gr_gid
    except KeyError:
        raise SchemaError(f"{where}: no group {g!r} on this machine") from None


def _metrics_socket(d: dict, default: str, where: str) -> str:
    path = d.get("metrics_socket", default)
    if not isinstance(path, str) or (path and not os.path.isabs(path)):
        raise SchemaError(f"{where}: metrics_socket must be an absolute path, the Unix socket to serve "
                          f"metrics on (e.g. \"/run/shmreplay/main.metrics.sock\"), got {path!r}")
    if len(os.fsencode(path)) > names.SOCKET_PATH_MAX:
        raise SchemaError(f"{where}: metrics_socket {path!r} is longer than a Unix socket path may be "
                          f"({names.SOCKET_PATH_MAX} bytes); choose a shorter one")
    return path
