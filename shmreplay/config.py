"""Daemon configuration (TOML) and the names both sides agree on.

Socket path, in order: ``--socket``, the config's ``daemon.socket``,
``$SHMREPLAY_SOCKET``, then ``default_socket_path()``.  A client uses its
``path`` argument, ``$SHMREPLAY_SOCKET``, then the same default, so a daemon
and a client started with no configuration always meet.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .errors import SchemaError
from .schema import TableSpec, spec_from_dict

ENV_SOCKET = "SHMREPLAY_SOCKET"
_INSTANCE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
DAEMON_KEYS = {"socket", "instance", "segment_mode", "spin_us", "idle_timeout_s", "log_level", "seed"}


def default_socket_path() -> str:
    return f"/tmp/shmreplay-{os.getuid()}.sock"


def client_socket_path(path: str | None = None) -> str:
    return path or os.environ.get(ENV_SOCKET) or default_socket_path()


@dataclass
class DaemonConfig:
    socket: str = ""
    instance: str = "default"
    segment_mode: int = 0o600
    spin_us: float = 250.0
    idle_timeout_s: float = 1.0
    log_level: str = "info"
    seed: int | None = None  # seeds every table's sampler (seed + table id): reproducible runs
    tables: list[TableSpec] = field(default_factory=list)

    def socket_path(self, override: str | None = None) -> str:
        return override or self.socket or os.environ.get(ENV_SOCKET) or default_socket_path()

    # names of shared objects: tables are stable per instance (a restarted
    # daemon finds them); channels and the doorbell carry the daemon's pid
    def table_segment(self, table: str) -> str:
        return f"/shmreplay.{self.instance}.t.{table}"

    def channel_segment(self, pid: int, cid: int) -> str:
        return f"/shmreplay.{self.instance}.{pid}.c{cid}"

    def doorbell(self, pid: int) -> str:
        return f"/shmreplay.{self.instance}.{pid}.bell"


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
    cfg.socket = str(d.get("socket", ""))
    cfg.instance = check_instance(str(d.get("instance", cfg.instance)))
    mode = d.get("segment_mode", "0600")
    try:
        cfg.segment_mode = int(mode, 8) if isinstance(mode, str) else int(mode)
    except ValueError as exc:
        raise SchemaError(f"{where}: segment_mode {mode!r} is not an octal mode") from exc
    cfg.spin_us = float(d.get("spin_us", cfg.spin_us))
    cfg.idle_timeout_s = float(d.get("idle_timeout_s", cfg.idle_timeout_s))
    cfg.log_level = str(d.get("log_level", cfg.log_level))
    if "seed" in d:
        if not isinstance(d["seed"], int) or d["seed"] < 0:
            raise SchemaError(f"{where}: seed must be an int >= 0, got {d['seed']!r}")
        cfg.seed = d["seed"]
    names = set()
    for i, t in enumerate(doc.get("tables", [])):
        if not isinstance(t, dict):
            raise SchemaError(f"{where}: tables[{i}] is not a table")
        spec = spec_from_dict(t, f"{where}: tables[{i}]")
        if spec.name in names:
            raise SchemaError(f"{where}: table {spec.name!r} is declared twice")
        names.add(spec.name)
        cfg.tables.append(spec)
    return cfg
