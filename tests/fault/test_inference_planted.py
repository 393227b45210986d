"""Issues 33 and 34: the inference channel and what it did not make
(docs/protocol.md, "Inference channel", "Objects and layout" and "Who may
call what").

* "Its address names the server's descriptor; an env refuses, unmapped,
  whatever else that descriptor number holds later (the token), anything
  not sealed against resizing, and another user's channel
  (``PermissionDenied``)."  Each test puts the object there first, as a
  squatter or a later open would, and leaves it as it was.
* Names in /dev/shm that earlier versions used, planted first: the
  channel has none, so they take nothing from it.
* "An env recomputes the layout from the schema and refuses
  (``LayoutError``) a segment whose header says otherwise", and "a process
  that rewrites them can make envs fail, never the server": bytes written
  into a real server's channel, one wrong thing at a time.
"""

import ctypes
import hashlib
import os
import re
import stat

import numpy as np
import posix_ipc
import pytest

import shmreplay
from inferencekit import (FORK, PREFIX, env_main, policy, raw_ctrl, raw_segment, reachable, serve, serve_env, server,
                          state, token_of)
from people import ADMIN, MEMBER, STRANGER, as_user, needs_root, users  # noqa: F401 (a fixture)
from shmreplay.inference import memfd as wfd
from waiting import HANG_S, reap, wait_for

TOKEN = "5badc0de5badc0de"
MAGIC = int.from_bytes(b"SHMRINF\x01", "little")  # the doc's magic, "SHMRINF\x01"
ME, OTHER = "this user, mode 0644", "another user, mode 0600"
ANOTHER = pytest.param(OTHER, marks=needs_root)
PR_SET_DUMPABLE = 4


def plant(entry: str, mode: int, size: int = 4096) -> None:
    """Make /dev/shm/<entry> as a squatter does: a segment, or a semaphore
    when ``entry`` starts with ``sem.``; with exactly ``mode``."""
    if entry.startswith("sem."):
        posix_ipc.Semaphore("/" + entry[4:], posix_ipc.O_CREX, mode=mode).close()
    else:
        posix_ipc.SharedMemory("/" + entry, posix_ipc.O_CREX, mode=mode, size=size).close_fd()
    os.chmod(os.path.join("/dev/shm", entry), mode)  # the umask took bits away


def plant_as(request, planter: str, entry: str, size: int = 4096) -> int:
    """Plant ``entry`` as ``planter`` (ME or OTHER); the planter's uid."""
    if planter == ME:
        plant(entry, 0o644, size)
        return os.geteuid()
    ident = request.getfixturevalue("users")[STRANGER]
    as_user(ident, plant, entry, 0o600, size)
    return ident[0]


def contents(entry: str):
    """The inode, owner, mode and a digest of the bytes: all a squatter made
    (None: it is gone)."""
    path = os.path.join("/dev/shm", entry)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    with open(path, "rb") as f:
        return st.st_ino, st.st_uid, stat.S_IMODE(st.st_mode), hashlib.sha256(f.read()).hexdigest()


def remove(entry: str) -> None:
    try:
        os.unlink(os.path.join("/dev/shm", entry))
    except FileNotFoundError:
        pass


def attach_error(address: str):
    """(class name, message) of what ``InferenceClient(address)`` raised,
    None if it attached; anything not a ReplayError propagates."""
    try:
        shmreplay.InferenceClient(address).close()
    except shmreplay.ReplayError as exc:
        return type(exc).__name__, str(exc)
    return None


def memfd_maps() -> list[str]:
    """This process's mappings of memfds and of /dev/shm files."""
    with open("/proc/self/maps") as f:
        return sorted(line.split(None, 5)[-1] for line in f if "memfd:" in line or "/dev/shm/" in line)


def at_descriptor(n: int, make) -> None:
    """Put what ``make()`` opens (a descriptor, closed here) at number ``n``."""
    fd = make()
    if fd != n:
        os.dup2(fd, n, inheritable=False)
        os.close(fd)


def test_an_address_whose_descriptor_holds_another_object_is_refused_unmapped(tmp_path):
    """A sealed channel's address (anyone of the user may have kept it)
    whose descriptor number holds something else now: another channel of
    the same fields (a token that is not the address's: ``InferenceClosed``,
    its slots untouched), a file with the channel's header but another
    token, short files, a FIFO (not opened: no hang), and a /dev/shm file
    holding the channel's exact bytes, token included (no seals: a
    ``LayoutError``, since its size could change under the mapping).  None
    is mapped: this process's memfd and /dev/shm mappings are the same
    after each refusal."""
    first, other = server(slots=2), server(slots=2)
    a, n = first.address, int(first.address.split("#")[0].rsplit("/", 1)[1])
    image = bytes(raw_segment(a))
    first.seal()
    assert not reachable(a)
    shm = f"/dev/shm/{PREFIX}.copy"
    with other:
        wrong = bytearray(image)
        wrong[13 * 8:14 * 8] = (int(token_of(a), 16) ^ 1).to_bytes(8, "little")
        files = {"wrong token": bytes(wrong), "empty": b"", "short": image[:64]}
        for name, data in files.items():
            (tmp_path / name).write_bytes(data)
        os.mkfifo(tmp_path / "fifo")
        gone = rf"^no inference channel at {re.escape(a)}: "
        cases = [("another channel", lambda: os.open(other.address.split("#")[0], os.O_RDWR),
                  shmreplay.InferenceClosed, gone + rf"descriptor {n} of process {os.getpid()} holds another "
                  r"object now \(not its token\)"),
                 *[(name, lambda name=name: os.open(tmp_path / name, os.O_RDWR), shmreplay.InferenceClosed,
                    gone + rf"descriptor {n} of process {os.getpid()} holds another object now")
                   for name in files],
                 ("fifo", lambda: os.open(tmp_path / "fifo", os.O_RDWR), shmreplay.InferenceClosed,
                  gone + "that descriptor holds no file now"),
                 ("dev/shm copy", lambda: os.open(shm, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600),
                  shmreplay.LayoutError, rf"^{re.escape(a)} is not sealed against shrinking and growing "
                  r"\(seals 0x1\): not a channel an InferenceServer made")]
        try:
            for what, make, error, match in cases:
                at_descriptor(n, make)
                if what == "dev/shm copy":
                    os.pwrite(n, image, 0)
                before = memfd_maps()
                with pytest.raises(error, match=match):
                    shmreplay.InferenceClient(a)
                assert memfd_maps() == before, what
                os.close(n)
                if what == "dev/shm copy":
                    os.unlink(shm)
            assert [state(raw_ctrl(other.address), k) for k in range(2)] == [(0, 0), (0, 0)]
        finally:
            if os.path.exists(shm):
                os.unlink(shm)
    first.close()


DERIVED = ["{base}", "sem.{base}.d", "sem.{base}.r0", "sem.{base}.r1", "{base}.d", "{base}.r0", "{base}.r1"]


@pytest.mark.parametrize("planter", [ME, ANOTHER])
def test_names_earlier_versions_used_take_nothing_from_the_channel(request, monkeypatch, planter):
    """Issue 34, item 1: a squatter that watches /dev/shm and creates the
    names a channel would use before the server does: version 2's segment
    ``<prefix>.<token>`` and version 1's semaphores (its doorbell ``.d``,
    its reply bells ``.r<i>``), and segments of those names.  Here they are
    all there before the server starts (the test fixes the token, as if
    the squatter had guessed it): the server starts, an env attaches and is
    served, and the squatter's objects are left as they were, since the
    channel has no name at all.  (Version 1 failed every start with
    ``ForeignObject``: "exists already"; version 2 refused its own name.)"""
    monkeypatch.setattr(wfd, "new_token", lambda: int(TOKEN, 16))
    base = f"{PREFIX}.{TOKEN}"
    planted = [e.format(base=base) for e in DERIVED]
    try:
        for entry in planted:
            plant_as(request, planter, entry)
        before = {e: contents(e) for e in planted}
        with server(slots=2) as srv:
            assert token_of(srv.address) == TOKEN
            serve_env(srv, 3, 20)
        assert {e: contents(e) for e in planted} == before
    finally:
        for entry in planted:
            remove(entry)


def become(ident, dumpable: bool) -> None:
    """This process becomes ``ident``, dumpable or not.  (A setuid without
    exec leaves it not dumpable, fs.suid_dumpable; a learner started by a
    login or an exec is dumpable, and must be, or no env of its user could
    open its descriptor.)"""
    uid, gid, groups = ident
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0)


def member_server(ident, conn) -> None:
    """An ordinary user's learner: a channel, serving until the test says."""
    become(ident, dumpable=True)
    with server(slots=2) as srv:
        conn.send((os.getpid(), srv.address))
        while not conn.poll(0):
            try:
                b = srv.receive(timeout=0.05)
            except shmreplay.ReplayTimeout:
                continue
            srv.respond(b.slots, action=policy(b.data["obs"]))
        conn.recv()
        stats = srv.stats()
    conn.send((reachable(srv.address), stats))


@needs_root
def test_a_user_who_may_not_open_the_channel_gets_permission_denied(users):
    """Issue 34, item 1: an env of another user (a member of the learner's
    group, a stranger) cannot open the learner's descriptor (the kernel
    lets only processes that may read the learner's memory: its user);
    it gets ``PermissionDenied`` naming the learner's user and saying to
    run the env as that user, never an OSError, and takes nothing: the
    learner's own env is served, no slot is held, no garbage counted.  A
    learner that is not dumpable refuses even its own user's envs: told
    so, with what to do."""
    with server(slots=1) as warm, shmreplay.InferenceClient(warm.address):
        pass  # compiled here: the other user's processes cannot read this user's modules or caches
    mine, theirs = FORK.Pipe()
    learner = FORK.Process(target=member_server, args=(users[MEMBER], theirs))
    env = None
    try:
        learner.start()
        wait_for(lambda: mine.poll(0) or learner.exitcode is not None, "the learner's address")
        pid, address = mine.recv()
        owner = f"{MEMBER} (uid {users[MEMBER][0]})"
        for who in (STRANGER, ADMIN):  # ADMIN: in the learner's group too
            ident = users[who]
            got = as_user(ident, attach_error, address)
            assert got == ("PermissionDenied", f"{address} is a descriptor of process {pid} of {owner} and this "
                           f"process runs as {who} (uid {ident[0]}): an inference channel is private to the user "
                           "of its InferenceServer; run the env processes as the learner's user (InferenceClient "
                           "never uses another user's channel)"), got
        env = FORK.Process(target=as_user, args=(users[MEMBER], env_main, address, 4, 5))
        env.start()
        env.join(HANG_S)
        assert env.exitcode == 0
        mine.send("close")
        assert mine.poll(HANG_S)
        left, stats = mine.recv()
        assert not left and (stats["served"], stats["garbage"], stats["lost"]) == (5, 0, 0), stats
        learner.join(HANG_S)
        assert learner.exitcode == 0
    finally:
        reap([learner, *([env] if env else [])])


def undumpable_server(ident, conn) -> None:
    """A learner of ``ident`` left not dumpable: serving until told."""
    become(ident, dumpable=False)
    with server(slots=1) as srv:
        conn.send((os.getpid(), srv.address))
        conn.poll(HANG_S * 10)


@needs_root
def test_a_learner_that_is_not_dumpable_says_so_to_its_own_users_envs(users):
    mine, theirs = FORK.Pipe()
    learner = FORK.Process(target=undumpable_server, args=(users[MEMBER], theirs))
    try:
        learner.start()
        assert mine.poll(HANG_S)
        pid, address = mine.recv()
        got = as_user(users[MEMBER], attach_error, address)
        assert got == ("PermissionDenied", f"{address}: the kernel does not let {MEMBER} (uid {users[MEMBER][0]}) "
                       f"open the descriptors of process {pid} (it is not dumpable: prctl(PR_SET_DUMPABLE, 0), "
                       "or it changed its user); keep the learner dumpable, or run the env processes as its "
                       "user"), got
        mine.send("end")
        learner.join(HANG_S)
        assert learner.exitcode == 0
    finally:
        reap([learner])


def write_header(buf, word: int, value: int) -> int:
    """Set header word ``word`` (the doc's order: magic, version, server pid,
    start time, state, slots, segment size, schema length, offsets and
    strides); its old value."""
    h = np.ndarray((16,), np.uint64, buf)
    old, h[word] = int(h[word]), value
    return old


def test_an_env_refuses_a_segment_whose_header_is_wrong():
    """Each wrong thing in a real server's header gets ``LayoutError`` saying
    what is wrong (inference/layout.py ``read_layout``); the server, whose
    header it was, serves on.  (The segment's size cannot be wrong: it is
    sealed, fault/test_inference_hostile.py.)"""
    bad_magic = int.from_bytes(b"NOTMINE!", "little")
    with server(slots=2) as srv:
        a = srv.address
        buf = raw_segment(a)
        size = len(buf)
        h0 = [int(x) for x in np.ndarray((16,), np.uint64, buf)]
        n = h0[7]
        schema = bytes(buf[128:128 + n])
        not_ours = rf"^{re.escape(a)} is not an inference channel of this build \(magic/version "
        unread = rf"^{re.escape(a)}: its schema does not read \("
        mismatch = rf"^{re.escape(a)}: its header does not match its schema \(segment {size} bytes\)$"
        for word, value, match in [
                (0, bad_magic, not_ours + rf"{bad_magic:#x}/3, expected {MAGIC:#x}/3\)$"),
                (1, 2, not_ours + rf"{MAGIC:#x}/2, expected {MAGIC:#x}/3\)$"),  # the version before
                (7, 0, unread + r"schema length 0\)$"),
                (7, size, unread + rf"schema length {size}\)$"),
                (5, 0, unread + r"slots=0: give the number of env processes"),
                (6, size + 64, mismatch),       # the segment size it states
                (8, h0[8] + 64, mismatch),      # where the control lines start
                (10, h0[10] + 16, mismatch)]:   # the request stride
            old = write_header(buf, word, value)
            with pytest.raises(shmreplay.LayoutError, match=match):
                shmreplay.InferenceClient(a)
            write_header(buf, word, old)
        for text, match in [(b"#" + schema[1:], unread + "Expecting value"),
                            (b'{"request": []}'.ljust(n), unread + r"'response'\)$")]:
            buf[128:128 + n] = text
            with pytest.raises(shmreplay.LayoutError, match=match):
                shmreplay.InferenceClient(a)
            buf[128:128 + n] = schema
        assert [state(raw_ctrl(a), k) for k in range(2)] == [(0, 0), (0, 0)]  # no env kept a slot
        env = FORK.Process(target=env_main, args=(a, 3, 5))
        try:
            env.start()
            serve(srv, 5)
            env.join(HANG_S)
            assert env.exitcode == 0
        finally:
            reap([env])
