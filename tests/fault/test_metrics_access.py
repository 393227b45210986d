"""Issue 34, item 3: the metrics endpoint that other local users cannot
read.  ``metrics_socket`` is a Unix socket made as the control socket is
(its mode and group, in a checked directory) and the scrape process asks
the kernel who connected (``SO_PEERCRED``/``SO_PEERGROUPS``) and applies
the control socket's rule (``access.may_connect``).  Real users made with
useradd: a member the config lets in scrapes; a user of the daemon's group
whom the config does not let in reaches the socket and gets 403; a stranger
outside the group cannot connect at all."""

import grp
import os
import socket
import stat

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from faults import FIELDS, rows  # noqa: E402
from people import (ADMIN, GROUP, MEMBER, STRANGER, as_user, needs_root,  # noqa: E402,F401 (fixtures)
                    shared_start, users)
from waiting import HANG_S, wait_for  # noqa: E402

pytestmark = needs_root


def get_metrics(path: str) -> str:
    """One ``GET /metrics`` over the Unix socket, as ``curl --unix-socket``
    sends it: the status line and the body, or the connect's refusal."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(HANG_S)  # a hang guard
    try:
        s.connect(path)
    except PermissionError:
        s.close()
        return "connect: permission denied"
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got.decode()
    finally:
        s.close()


def test_over_the_unix_socket_a_member_scrapes_and_others_are_refused(shared_start, users):
    path = os.path.join(shared_start.dir, "metrics.sock")
    d = shared_start(allowed_users=[MEMBER], metrics_socket=path,
                     tables=[{"name": "private", "capacity": 64, "fields": FIELDS}])
    with d.connect() as c:
        c.table("private").insert_batch(rows(np.arange(5)))
        c.flush()
        assert c.stats()["metrics"] == f"unix:{path}"
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == grp.getgrnam(GROUP).gr_gid
    wait_for(lambda: 'shmreplay_table_items{table="private"} 5.0' in get_metrics(path),
             "the owner's scrape to show the table")
    member = as_user(users[MEMBER], get_metrics, path)
    assert member.startswith("HTTP/1.1 200 ") and 'table="private"' in member, member[:300]
    # in the socket's group (the file lets it connect) but not let in by the config
    other = as_user(users[ADMIN], get_metrics, path)
    assert other.startswith("HTTP/1.1 403 ") and "private" not in other, other
    assert as_user(users[STRANGER], get_metrics, path) == "connect: permission denied"
    # the refusals cost nothing: the owner still scrapes
    assert get_metrics(path).startswith("HTTP/1.1 200 ")
