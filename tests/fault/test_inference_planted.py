"""Issues 33 and 34: the inference channel and what it did not make
(docs/protocol.md, "Inference channel", "Objects and layout" and "Who may
call what").

* "The server never opens a name it did not create.  An env opens only
  an existing name, and only a regular file of its own user with no group
  or other bits (``ForeignObject`` otherwise, ``PermissionDenied`` where it
  may not open it)."  Each test plants the object
  first, as a squatter would (this user with a mode a server never sets, or
  another user: root only, tests/fault/people.py); the channel refuses it
  with an error naming it, and leaves it exactly as it was.
* "An env recomputes the layout from the schema and refuses
  (``LayoutError``) a segment whose header says otherwise", and "a process
  that rewrites them can make envs fail, never the server": bytes written
  into a real server's segment, one wrong thing at a time.
"""

import hashlib
import mmap
import os
import re
import stat

import numpy as np
import posix_ipc
import pytest

import shmreplay
from inferencekit import FORK, PREFIX, env_main, names_of, policy, raw_ctrl, serve, server, state
from people import ADMIN, MEMBER, STRANGER, as_user, needs_root, users  # noqa: F401 (a fixture)
from shmreplay.wire import inference as wi
from waiting import HANG_S, reap, wait_for

TOKEN = "5badc0de5badc0de"
MAGIC = int.from_bytes(b"SHMRINF\x01", "little")  # the doc's magic, "SHMRINF\x01"
ME, OTHER = "this user, mode 0644", "another user, mode 0600"
ANOTHER = pytest.param(OTHER, marks=needs_root)


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


@pytest.mark.parametrize("planter", [ME, ANOTHER])
def test_an_env_refuses_a_segment_planted_at_its_address(request, planter):
    """A name at an address (a sealed or closed channel's, which anyone may
    have read) that the user's server did not make: ``ForeignObject`` naming
    it for an env that can open it; an ordinary user's env, which cannot
    even open another user's 0600 segment, gets ``PermissionDenied`` naming
    its owner, never posix_ipc's own error."""
    address = f"/{PREFIX}.{TOKEN}"
    entry = address[1:]
    try:
        uid = plant_as(request, planter, entry)
        before = contents(entry)
        why = "mode 0644, not 0600" if planter == ME else f"owned by uid {uid}, not {os.geteuid()}"
        match = rf"^/dev/shm{re.escape(address)} is not an object .*\({why}\); not using it"
        with pytest.raises(shmreplay.ForeignObject, match=match):
            shmreplay.InferenceClient(address)
        if planter == OTHER:  # an env that is not root cannot open it: told whose it is
            people = request.getfixturevalue("users")
            assert as_user(people[MEMBER], attach_error, address) == (
                "PermissionDenied", f"/dev/shm{address} belongs to {STRANGER} (uid {uid}) and this process "
                f"runs as {MEMBER} (uid {people[MEMBER][0]}): an inference channel is private to the user "
                "of its InferenceServer; run the env processes as the learner's user (InferenceClient "
                "never uses another user's channel)")
        assert contents(entry) == before
    finally:
        remove(entry)


DERIVED = ["sem.{base}.d", "sem.{base}.r0", "sem.{base}.r1", "{base}.d", "{base}.r0", "{base}.r1"]


@pytest.mark.parametrize("planter", [ME, ANOTHER])
def test_names_derived_from_the_channels_take_nothing_from_it(request, monkeypatch, planter):
    """Issue 34, item 1: a squatter that watches /dev/shm and, as soon as a
    channel's segment appears, creates every name derived from it (the
    semaphores an earlier version made next to it: its doorbell ``.d``, its
    reply bells ``.r<i>``; and segments of those names).  Here they are all
    there before the server starts (the squatter won every race; the test
    fixes the token so that the names are known): the server starts,
    envs attach and are served, and the squatter's objects are left as
    they were.  On the code before (semaphores ``sem.<name>.d``/``.r<i>``
    made with O_CREX after the segment) every start failed with
    ``ForeignObject``: "exists already"."""
    monkeypatch.setattr(wi.secrets, "token_hex", lambda n: TOKEN)
    base = f"{PREFIX}.{TOKEN}"
    planted = [e.format(base=base) for e in DERIVED]
    try:
        for entry in planted:
            plant_as(request, planter, entry)
        before = {e: contents(e) for e in planted}
        with server(slots=2) as srv:
            assert srv.address == "/" + base
            env = FORK.Process(target=env_main, args=(srv.address, 3, 20))
            try:
                env.start()
                serve(srv, 20)
                env.join(HANG_S)
                assert env.exitcode == 0
            finally:
                reap([env])
        assert {e: contents(e) for e in planted} == before
    finally:
        for entry in planted:
            remove(entry)
        remove(base)


def member_server(ident, conn) -> None:
    """An ordinary user's learner: a channel, serving until the test says."""
    uid, gid, groups = ident
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    with server(slots=2) as srv:
        conn.send(srv.address)
        while not conn.poll(0):
            try:
                b = srv.receive(timeout=0.05)
            except shmreplay.ReplayTimeout:
                continue
            srv.respond(b.slots, action=policy(b.data["obs"]))
        conn.recv()
        stats = srv.stats()
    conn.send((sorted(names_of(srv.address)), stats))


@needs_root
def test_a_user_who_may_not_open_the_channel_gets_permission_denied(users):
    """Issue 34, item 1: an env of another user (a member of the learner's
    group, a stranger) cannot open the learner's 0600 segment; it gets
    ``PermissionDenied`` naming the channel's owner and saying to run the
    env as that user, never posix_ipc's own error, and takes nothing: the
    learner's own env is served, no slot is held, and its stats show no
    garbage.  (Root may open it, and is refused as a ``ForeignObject``
    naming the owner: test_an_env_refuses_a_segment_planted_at_its_address.)"""
    with server(slots=1) as warm, shmreplay.InferenceClient(warm.address):
        pass  # compiled here: the other user's processes cannot read this user's modules or caches
    mine, theirs = FORK.Pipe()
    learner = FORK.Process(target=member_server, args=(users[MEMBER], theirs))
    address = env = None
    try:
        learner.start()
        wait_for(lambda: mine.poll(0) or learner.exitcode is not None, "the learner's address")
        address = mine.recv()
        owner = f"{MEMBER} (uid {users[MEMBER][0]})"
        for who in (STRANGER, ADMIN):  # ADMIN: in the learner's group too
            ident = users[who]
            got = as_user(ident, attach_error, address)
            assert got == ("PermissionDenied", f"/dev/shm{address} belongs to {owner} and this process runs "
                           f"as {who} (uid {ident[0]}): an inference channel is private to the user of its "
                           "InferenceServer; run the env processes as the learner's user (InferenceClient "
                           "never uses another user's channel)"), got
        env = FORK.Process(target=as_user, args=(users[MEMBER], env_main, address, 4, 5))
        env.start()
        env.join(HANG_S)
        assert env.exitcode == 0
        mine.send("close")
        assert mine.poll(HANG_S)
        left, stats = mine.recv()
        assert left == [] and (stats["served"], stats["garbage"], stats["lost"]) == (5, 0, 0), stats
        learner.join(HANG_S)
        assert learner.exitcode == 0
    finally:
        reap([learner, *([env] if env else [])])
        if address is not None:  # the learner killed by reap: its segment
            remove(address[1:])


@pytest.mark.parametrize("planter", [ME, ANOTHER])
def test_a_server_refuses_a_segment_planted_at_its_name(request, monkeypatch, planter):
    """The server's own segment name, planted first (the random token cannot
    be guessed; the test fixes it so that the name is known in advance, as
    it would be to a squatter who learned it): the server refuses it with
    an error naming it, and leaves the squatter's as it was."""
    monkeypatch.setattr(wi.secrets, "token_hex", lambda n: TOKEN)
    base = f"{PREFIX}.{TOKEN}"
    entry = base
    try:
        uid = plant_as(request, planter, entry)
        before = contents(entry)
        if planter == ME:
            error, match = shmreplay.ReplayError, rf"^shared-memory segment /{re.escape(base)} exists already"
        else:
            error, match = shmreplay.ForeignObject, rf"^/dev/shm/{re.escape(base)} is not an object .*" \
                                                    rf"\(owned by uid {uid}, not {os.geteuid()}\)"
        with pytest.raises(error, match=match):
            server(slots=2)
        assert contents(entry) == before
        assert {n for n in os.listdir("/dev/shm") if base in n} == {entry}
    finally:
        remove(entry)


def write_header(buf, word: int, value: int) -> int:
    """Set header word ``word`` (the doc's order: magic, version, server pid,
    start time, state, slots, segment size, schema length, offsets and
    strides); its old value."""
    h = np.ndarray((16,), np.uint64, buf)
    old, h[word] = int(h[word]), value
    return old


def test_an_env_refuses_a_segment_whose_header_is_wrong():
    """Each wrong thing in a real server's header gets ``LayoutError`` saying
    what is wrong (wire/inference.py ``read_layout``); a segment too short
    for a header, too; the server, whose header it was, serves on."""
    bad_magic = int.from_bytes(b"NOTMINE!", "little")
    with server(slots=2) as srv:
        a = srv.address
        shm = posix_ipc.SharedMemory(a)
        try:
            size = os.fstat(shm.fd).st_size
            buf = mmap.mmap(shm.fd, size)
            h0 = [int(x) for x in np.ndarray((16,), np.uint64, buf)]
            n = h0[7]
            schema = bytes(buf[128:128 + n])
            not_ours = rf"^{re.escape(a)} is not an inference channel of this build \(magic/version "
            unread = rf"^{re.escape(a)}: its schema does not read \("
            mismatch = rf"^{re.escape(a)}: its header does not match its schema \(segment {size} bytes\)$"
            for word, value, match in [
                    (0, bad_magic, not_ours + rf"{bad_magic:#x}/2, expected {MAGIC:#x}/2\)$"),
                    (1, 1, not_ours + rf"{MAGIC:#x}/1, expected {MAGIC:#x}/2\)$"),  # the version before
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
            os.ftruncate(shm.fd, size + 4096)  # a header that matches, a segment that does not
            longer = mismatch.replace(f"{size} bytes", f"{size + 4096} bytes")
            with pytest.raises(shmreplay.LayoutError, match=longer):
                shmreplay.InferenceClient(a)
            os.ftruncate(shm.fd, size)
        finally:
            shm.close_fd()
        assert [state(raw_ctrl(a), k) for k in range(2)] == [(0, 0), (0, 0)]  # no env kept a slot
        env = FORK.Process(target=env_main, args=(a, 3, 5))
        try:
            env.start()
            serve(srv, 5)
            env.join(HANG_S)
            assert env.exitcode == 0
        finally:
            reap([env])
    for length in (0, 64):
        short = f"/{PREFIX}.{TOKEN}"
        try:
            plant(short[1:], 0o600, size=length)
            with pytest.raises(shmreplay.LayoutError, match=rf"^{re.escape(short)} is {length} bytes: "
                               "not an inference channel$"):
                shmreplay.InferenceClient(short)
        finally:
            remove(short[1:])
