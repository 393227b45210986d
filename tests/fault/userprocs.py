"""Long-lived processes of the real users ``people.py`` makes: a program
(a ``shmreplay.Server``, a daemon, a client) run as that user while the test
acts as another.

``as_user`` forks and returns; these stay up until the test closes their
stdin.  Each user gets a home of its own (a fresh 0700 directory it owns)
and a numba cache in it, seeded with the kernels this checkout's processes
compiled (``__pycache__``, which another user may read but not write), so
its first daemon loads them instead of compiling for a minute.

Test code only; one test at a time per user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import shmreplay

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its shmreplay, not site-packages'


def compile_kernels() -> None:
    """Run every kernel a daemon and a client use once, as this (root)
    process's user, so their compiled form sits in ``__pycache__``."""
    with shmreplay.Server(tables=[dict(name="warm", capacity=64, fields={"x": ("float32", (4,))},
                                       sampler="prioritized")],
                          instance=f"test{os.getpid()}warm") as s, s.connect() as c:
        t = c.table("warm")
        t.insert_batch({"x": np.zeros((64, 4), np.float32)})
        c.flush()
        t.sample(8)


def make_home(ident) -> Path:
    """A home for the user ``ident`` (uid, gid, groups): 0700, theirs, with
    a numba cache seeded from this checkout's.  ``remove_home`` removes it."""
    from numba.core.caching import UserProvidedCacheLocator
    uid, gid, _ = ident
    home = Path(tempfile.mkdtemp(prefix="shmrhome"))
    cache = home / "numba"
    for pyc in (ROOT / "shmreplay").rglob("__pycache__"):
        kernels = [p for p in pyc.iterdir() if p.suffix in (".nbi", ".nbc")]
        if kernels:  # numba keys a cache by the source's folder as the user's process sees it (code_at)
            seen = code_at(home) / pyc.parent.relative_to(ROOT)
            where = cache / UserProvidedCacheLocator.get_suitable_cache_subpath(str(seen / "x.py"))
            where.mkdir(parents=True, exist_ok=True)
            for p in kernels:
                shutil.copy2(p, where / p.name)
    cache.mkdir(exist_ok=True)
    for d, dirs, files in os.walk(home):
        for n in [d, *(os.path.join(d, x) for x in dirs + files)]:
            os.lchown(n, uid, gid)
    os.chmod(home, 0o700)
    return home


def code_at(home: Path) -> Path:
    """Where the user's process sees this checkout: bound there in its
    mount namespace (``spawn``), since the checkout may sit in a folder
    other users cannot enter (a fresh clone under ``mktemp -d``, 0700)."""
    return home.parent / (home.name + ".code")


# The user's process runs in a mount namespace of its own where the
# checkout is bound at ``code_at(home)``, and, where the interpreter lives
# out of other users' reach (pyenv under /root, mode 0700), /root is an
# empty 0755 tmpfs with the interpreter's tree bound back at its own path
# (so its library paths hold), and nothing else.
HIDDEN = "/root"
MOUNTS = """set -e
mount --bind "$CODE_FROM" "$CODE"
if [ -n "$STASH" ]; then
  mount --bind "$STASH_FROM" "$STASH"
  mount -t tmpfs -o mode=0755,size=1m shmrroot /root
  mkdir -p "$STASH_FROM"
  mount --move "$STASH" "$STASH_FROM"
fi
exec "$@"
"""


def spawn(ident, home: Path, code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Run ``python -c code args`` as ``ident`` with ``home``; its stdin is
    a pipe (closing it is the program's cue to end), its stdout a pipe of
    JSON lines (``read``)."""
    uid, gid, groups = ident
    checkout = code_at(home)
    checkout.mkdir(mode=0o755, exist_ok=True)  # a mount point, in its namespace only
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(checkout), "HOME": str(home),
            "NUMBA_CACHE_DIR": str(home / "numba"), "LANG": "C.UTF-8", "CODE": str(checkout),
            "CODE_FROM": str(ROOT), "STASH": ""}
    drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups", "--",
            sys.executable, "-c", code, *args]
    prefix = os.path.realpath(sys.base_prefix)
    if prefix.startswith(HIDDEN + "/"):
        stash = home.parent / (home.name + ".python")  # a mount point for a moment, in its namespace only
        stash.mkdir(exist_ok=True)
        top = prefix[:prefix.index("/", len(HIDDEN) + 1)] if "/" in prefix[len(HIDDEN) + 1:] else prefix
        base.update(STASH=str(stash), STASH_FROM=top)
    drop = ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNTS, "sh", *drop]
    return subprocess.Popen(drop, env={**base, **(env or {})}, cwd=str(home), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read(proc: subprocess.Popen) -> dict:
    """The next JSON line the program printed (its stderr if it ended instead)."""
    line = proc.stdout.readline()
    if not line:
        proc.wait(60)
        raise AssertionError(f"the user's program exited {proc.returncode}:\n{proc.stderr.read()}")
    return json.loads(line)


def finish(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """Close its stdin and wait (a hang guard, then SIGKILL); its stderr."""
    try:
        proc.stdin.close()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    return err


def remove_home(home: Path) -> None:
    shutil.rmtree(home)
    for point in (home.parent / (home.name + ".python"), code_at(home)):
        if point.exists():
            point.rmdir()
