"""Run inside a private mount namespace whose /dev/shm is a small tmpfs
(see fault/test_exhaustion.test_full_dev_shm_...): fills /dev/shm and checks that the
daemon reports it clearly and keeps serving.  Prints one JSON line."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

import shmreplay

FIELDS = {"x": ("uint8", (1024,))}


def main() -> int:
    tmp = tempfile.mkdtemp()
    sock = os.path.join(tmp, "d.sock")
    cfg = os.path.join(tmp, "d.toml")
    with open(cfg, "w") as f:
        f.write(f'[daemon]\ninstance = "testfull"\nsocket = "{sock}"\n')
    d = subprocess.Popen([sys.executable, "-m", "shmreplay.server.daemon", "--config", cfg],
                         stderr=subprocess.DEVNULL)
    out = {}
    try:
        deadline = time.monotonic() + 120  # a hang guard: the daemon listens once it is up
        while True:
            try:
                c = shmreplay.connect(sock, timeout=60)
                break
            except shmreplay.DaemonUnavailable:
                if time.monotonic() > deadline or d.poll() is not None:
                    raise
                time.sleep(0.1)
        a = c.create_table("a", capacity=4096, fields=FIELDS)  # ~4 MiB
        a.insert_batch({"x": np.full((100, 1024), 7, np.uint8)})
        a.flush()
        st = os.statvfs("/dev/shm")
        hog = os.open("/dev/shm/hog", os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(hog, 0, st.f_bavail * st.f_frsize - (1 << 20))  # leave 1 MiB
        try:
            c.create_table("b", capacity=4096, fields=FIELDS)
        except shmreplay.ShmFull as exc:
            out["create"] = str(exc)
        # channels are memfds, not /dev/shm objects: a full /dev/shm does not
        # keep a client from attaching (and using the tables that exist)
        with shmreplay.connect(sock, timeout=60) as c3:
            out["attach"] = len(c3.table("a")) == 100
        a.insert_batch({"x": np.full((100, 1024), 9, np.uint8)})
        a.flush()
        b = a.sample(64)
        out["still_serving"] = len(a) == 200 and bool(np.all((b.data["x"] == 7) | (b.data["x"] == 9)))
        os.close(hog)
        os.unlink("/dev/shm/hog")
        with shmreplay.connect(sock, timeout=60) as c2:
            c2.create_table("b", capacity=4096, fields=FIELDS)
            out["recovered"] = sorted(c2.list_tables()) == ["a", "b"]
        c.close()
    finally:
        d.send_signal(signal.SIGTERM)
        out["daemon_exit"] = d.wait(60)
        out["left"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
