"""A real systemd, PID 1 of its own pid, mount, UTS and cgroup namespaces,
for the tests of the production unit (test_systemd_service.py).

The test machine has no systemd PID 1, and the unit's promises are about
what systemd does with it: start when the daemon says READY=1, restart a
crashed daemon, keep the runtime directory, run the daemon as its system
user in its sandbox.  So a test boots one (``systemd --system``, systemd
252 here) and runs the repository's unit, unchanged, under it:

* the box sees the host's files through overlays on /etc, /opt and /var:
  everything the test and systemd write there (the unit, the user that
  ``systemd-sysusers`` makes from the repository's sysusers.d file, the
  config, StateDirectory, CacheDirectory) lands in the box's upper
  directories and never on the host;
* /run and /tmp are the box's own tmpfs, and the system unit directories
  are hidden behind stub targets, so no unit of the host's (tmpfiles'
  /tmp cleaning among them) can start;
* its cgroup root is a cgroup made for it (``shmreplay-test<pid>``), so two
  boxes, or a box and the host, never share one;
* /dev/shm is the host's: the daemon's segments are where the tests (and
  their leak checks) see them.

The daemon must run the Python and the shmreplay package the tests use,
which may live where the sandbox hides them (``ProtectHome=`` hides /root,
``PrivateTmp=`` a checkout under /tmp, and /root is 0700 anyway): the box
bind-mounts the interpreter's prefix at /opt/shmreplay/python, the
directory holding the package at /opt/shmreplay/src, and a shared
libpython over the C library path's copy (the loader falls back to it when
the interpreter's RUNPATH is out of reach), and installs
/opt/shmreplay/venv/bin/shmreplayd, the path the unit starts, as a script
that runs the daemon from those.

Root only (namespaces, mounts, cgroups).  ``close`` kills the box's PID 1,
which ends every process in it, and removes its cgroups.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import shmreplay

SYSTEMD = "/lib/systemd/systemd"
STUB_TARGETS = ("sysinit", "syslog", "basic", "local-fs", "local-fs-pre", "multi-user", "sockets", "timers", "paths",
                "slices", "shutdown", "umount", "final", "network", "network-online", "swap")
MANAGER_CONF = """[Manager]
DefaultTasksAccounting=no
DefaultMemoryAccounting=no
DefaultCPUAccounting=no
DefaultIOAccounting=no
DefaultIPAccounting=no
"""
# the journal, so a unit's output can be read (journalctl) when a test fails
JOURNALD = ("systemd-journald.service", "systemd-journald.socket", "systemd-journald-dev-log.socket",
            "systemd-journald-audit.socket")
HIERARCHIES = ("systemd", "unified")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(shmreplay.__file__)))  # the tests' shmreplay  # name=systemd (v1) and the v2 tree beside it: hybrid, as here
BOOT_S = 60.0  # hang guards
CALL_S = 120.0


def usable() -> str | None:
    """Why a box cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (namespaces, mounts and cgroups)"
    for tool in (SYSTEMD, shutil.which("unshare"), shutil.which("nsenter"), shutil.which("systemd-sysusers")):
        if not tool or not os.path.exists(tool):
            return f"needs systemd, unshare, nsenter and systemd-sysusers ({tool} missing)"
    if any(not os.path.isdir(f"/sys/fs/cgroup/{h}") for h in HIERARCHIES):
        return "needs the hybrid cgroup layout of this machine (/sys/fs/cgroup/systemd and /unified)"
    if sys.prefix != sys.base_prefix:
        return "runs the daemon from the interpreter's own prefix, not a virtual environment"
    return None


def shared_libpython() -> tuple[str, str] | None:
    """(the interpreter's shared libpython, the C library path's file of that
    name) when the interpreter links one, else None."""
    out = subprocess.run(["ldd", os.path.realpath(sys.executable)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name, _, rest = line.strip().partition(" => ")
        if name.startswith("libpython") and rest:
            lib = rest.split()[0]
            fallback = f"/usr/lib/{os.uname().machine}-linux-gnu/{name}"
            if not os.path.exists(fallback):
                raise RuntimeError(f"{sys.executable} needs {lib}, which the service cannot reach under "
                                   f"/root, and there is no {fallback} to mount it over")
            return lib, fallback
    return None


class SystemdBox:
    def __init__(self, base: Path):
        self.base = base
        self.cgroup = f"shmreplay-test{os.getpid()}box{id(self) & 0xffff:x}"
        self.pid1: int | None = None
        self.proc: subprocess.Popen | None = None
        try:
            self.boot()
        except BaseException:  # a box that did not come up is ended all the same
            self.close()
            raise

    # ---- boot and close ----
    def boot(self) -> None:
        b = self.base
        units = b / "units"
        units.mkdir(parents=True)
        for t in STUB_TARGETS:
            (units / f"{t}.target").write_text(
                f"[Unit]\nDescription={t} (a stub: no system unit runs in the test box)\nDefaultDependencies=no\n")
        (units / "box.target").write_text("[Unit]\nDescription=the test box: the journal, nothing else\n"
                                          "DefaultDependencies=no\nWants=systemd-journald.service\n")
        (b / "system.conf").write_text(MANAGER_CONF)
        (b / "journald.conf").write_text("[Journal]\nStorage=volatile\nReadKMSG=no\n")  # not the host's kernel log
        for u in JOURNALD:  # copied before /usr/lib/systemd/system is hidden
            shutil.copy(f"/usr/lib/systemd/system/{u}", b / u)
        lines = ["set -e"]
        for d in ("etc", "opt", "var"):
            for sub in ("up", "work"):
                (b / d / sub).mkdir(parents=True)
            lines.append(f"mount -t overlay overlay -o lowerdir=/{d},upperdir={b}/{d}/up,workdir={b}/{d}/work /{d}")
        lines += ["mount -t tmpfs -o mode=0755 tmpfs /run",
                  "mount -t tmpfs -o mode=0755 tmpfs /usr/lib/systemd/system",
                  "mount -t tmpfs -o mode=0755 tmpfs /etc/systemd/system",
                  f"cp {units}/* /etc/systemd/system/",
                  *(f"cp {b}/{u} /etc/systemd/system/" for u in JOURNALD),
                  f"cp {b}/system.conf /etc/systemd/system.conf",
                  f"cp {b}/journald.conf /etc/systemd/journald.conf",
                  "mount -t tmpfs -o mode=0755 tmpfs /sys/fs/cgroup",
                  "mkdir /sys/fs/cgroup/systemd /sys/fs/cgroup/unified",
                  "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd",
                  "mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified"]
        lines += self._interpreter_mounts()
        lines += ["mount -t proc proc /proc",
                  "mount -t tmpfs -o mode=1777 tmpfs /tmp",  # last: the lines above read the test's tmp dir
                  "export container=shmreplay-test",
                  f"exec {SYSTEMD} --system --unit=box.target"]
        (b / "boot.sh").write_text("\n".join(lines) + "\n")
        for h in HIERARCHIES:
            os.mkdir(f"/sys/fs/cgroup/{h}/{self.cgroup}")
        join = "; ".join(f'echo $$ > /sys/fs/cgroup/{h}/{self.cgroup}/cgroup.procs' for h in HIERARCHIES)
        self.log = open(b / "boot.log", "wb")
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", f"{join}; exec unshare --pid --fork --mount --uts --cgroup --propagation private "
                              f"/bin/sh {b}/boot.sh"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + BOOT_S
        while self.pid1 is None:
            self._check_alive()
            try:
                with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                    kids = f.read().split()
            except OSError:
                kids = []
            if kids and os.path.realpath(f"/proc/{kids[0]}/exe") == os.path.realpath(SYSTEMD):
                self.pid1 = int(kids[0])
            elif time.monotonic() > deadline:
                raise AssertionError(f"no systemd in the box after {BOOT_S} s:\n{self.boot_log()}")
            else:
                time.sleep(0.05)
        while (state := self.run("systemctl", "is-system-running", check=False).stdout.strip()) not in (
                "running", "degraded"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"the box's systemd is {state!r} after {BOOT_S} s:\n{self.boot_log()}")
            time.sleep(0.05)
        self.install_daemon()

    def _interpreter_mounts(self) -> list[str]:
        """Where the unit's /opt/shmreplay/venv/bin/shmreplayd finds this
        interpreter and this shmreplay package (see the module's docstring)."""
        lines = ["mkdir -p /opt/shmreplay/python /opt/shmreplay/src /opt/shmreplay/venv/bin",
                 f"mount --bind {sys.base_prefix} /opt/shmreplay/python",
                 f"mount --bind {PACKAGE_PARENT} /opt/shmreplay/src"]
        lib = shared_libpython()
        if lib is not None:
            lines.append(f"mount --bind {lib[0]} {lib[1]}")
        python = f"/opt/shmreplay/python/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        script = (f"#!{python}\n"
                  "import sys\n"
                  "sys.path.insert(0, '/opt/shmreplay/src')  # the tests' shmreplay, editable or not\n"
                  "from shmreplay.numbaconf import exit_without_teardown\n"
                  "from shmreplay.server.daemon import main\n"
                  "exit_without_teardown(main())\n")
        (self.base / "shmreplayd").write_text(script)
        lines.append(f"install -m 0755 {self.base}/shmreplayd /opt/shmreplay/venv/bin/shmreplayd")
        return lines

    def install_daemon(self) -> None:
        """The repository's unit and its user, as docs/operations.md installs them."""
        root = Path(self.root)
        repo = Path(__file__).resolve().parent.parent
        shutil.copy(repo / "systemd" / "shmreplay@.service", root / "etc/systemd/system/shmreplay@.service")
        (root / "etc/sysusers.d").mkdir(exist_ok=True)
        shutil.copy(repo / "systemd" / "sysusers.d" / "shmreplay.conf", root / "etc/sysusers.d/shmreplay.conf")
        self.run("systemd-sysusers")
        self.run("systemctl", "daemon-reload")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the box ended (exit {self.proc.returncode}):\n{self.boot_log()}")

    def boot_log(self) -> str:
        self.log.flush()
        return (self.base / "boot.log").read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """Kill the box's PID 1 (the kernel then kills everything in it) and
        remove its cgroups, deepest first."""
        if self.pid1 is not None:
            try:
                os.kill(self.pid1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.pid1 is None and self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # no systemd yet: end the boot script and unshare
        if self.proc is not None:
            try:
                self.proc.wait(CALL_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(CALL_S)
            self.log.close()
        for h in HIERARCHIES:
            top = f"/sys/fs/cgroup/{h}/{self.cgroup}"
            if not os.path.isdir(top):
                continue
            deadline = time.monotonic() + CALL_S  # a cgroup is busy until its last process is reaped
            for d in sorted((p for p, _, _ in os.walk(top)), key=len, reverse=True):
                while os.path.isdir(d):
                    try:
                        os.rmdir(d)
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

    # ---- inside ----
    @property
    def root(self) -> str:
        """The box's / seen from the host (its overlays, its /run)."""
        return f"/proc/{self.pid1}/root"

    def run(self, *argv: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        """A command in the box's mount and pid namespaces, as root."""
        cmd = ["nsenter", "-t", str(self.pid1), "-m", "-p", *(["env", *(f"{k}={v}" for k, v in env.items())]
                                                              if env else []), *argv]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CALL_S)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {p.returncode} in the box:\n{p.stdout}{p.stderr}\n"
                                 f"the box's journal:\n{self.journal()}")
        return p

    def journal(self, lines: int = 80) -> str:
        p = subprocess.run(["nsenter", "-t", str(self.pid1), "-m", "-p", "journalctl", "--no-pager", "-n", str(lines),
                            "-u", "shmreplay@*"],
                           capture_output=True, text=True, timeout=CALL_S)
        return p.stdout + p.stderr

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def host_pid(self, unit: str) -> int:
        """The unit's main process, as a pid of the host (systemd answers
        with the box's pid namespace's number)."""
        inner = int(self.show(unit, "MainPID")["MainPID"])
        assert inner > 0, f"{unit} has no main process"
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        ns = next((ln for ln in f if ln.startswith("NSpid:")), "").split()
                except OSError:
                    continue
                if len(ns) == 3 and int(ns[2]) == inner and self._in_box(int(pid)):
                    return int(pid)
        raise AssertionError(f"no host process is {unit}'s main pid {inner}")

    def _in_box(self, pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{self.pid1}/ns/pid")
        except OSError:
            return False
