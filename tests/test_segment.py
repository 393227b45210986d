"""Segments are populated up front: the creator zeroes every page and each
attaching process maps them all (wire/segment.py, ``prefault``), so writing
rows later takes no page fault.  Shown by state: the kernel's own count of
each mapping's resident pages in this process (``Rss`` in
/proc/self/smaps, pages this process's page tables map) is the whole
segment right after create and after attach, before anything touched it.
(A count of page faults around a write, as this test once made, depends on
what numpy and the allocator fault in beside it.)"""

import os

import numpy as np

from shmreplay.wire.segment import Segment

SIZE = 16 << 20  # 4,096 pages of 4 KiB


def mapped_kib(path: str) -> list[tuple[int, int]]:
    """(Size, Rss) in KiB of each mapping of ``path`` in this process."""
    out, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's first line
                current = [0, 0] if len(head) >= 6 and head[5] == path else None
                if current is not None:
                    out.append(current)
            elif current is not None and head[0] in ("Size:", "Rss:"):
                current[0 if head[0] == "Size:" else 1] = int(head[1])
    return [tuple(m) for m in out]


def test_created_and_attached_mappings_are_mapped_whole_before_any_access():
    name = f"/shmreplay.test{os.getpid()}.prefault"
    path = "/dev/shm" + name
    created = Segment.create(name, SIZE)
    try:
        assert mapped_kib(path) == [(SIZE >> 10, SIZE >> 10)]  # every page made and mapped by the creator
        attached = Segment.attach(name)
        try:
            assert mapped_kib(path) == [(SIZE >> 10, SIZE >> 10)] * 2  # and by the attacher, before any read
            np.frombuffer(created.buf, dtype=np.uint8)[::4096] = 7
            assert np.frombuffer(attached.buf, dtype=np.uint8)[::4096].min() == 7  # one memory
        finally:
            attached.close()
    finally:
        created.close()
        created.unlink()
