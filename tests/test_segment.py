"""Segments are populated up front: the creator zeroes every page and each
attaching process maps them all, so writing rows later takes no page fault.
Measured with the process's own minor-fault counter."""

import os
import resource

import numpy as np

from shmreplay.wire.segment import Segment

SIZE = 16 << 20  # 4,096 pages of 4 KiB


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _write_every_page(seg: Segment) -> int:
    view = np.frombuffer(seg.buf, dtype=np.uint8)
    before = _minor_faults()
    view[::4096] = 7
    faults = _minor_faults() - before
    del view
    return faults


def test_created_and_attached_mappings_take_no_write_faults():
    name = f"/shmreplay.test{os.getpid()}.prefault"
    created = Segment.create(name, SIZE)
    try:
        attached = Segment.attach(name)
        try:
            # one fault per page (4,096) without the populates; a handful
            # of faults is numpy's own allocations
            assert _write_every_page(created) < 64
            assert _write_every_page(attached) < 64
            assert np.frombuffer(attached.buf, dtype=np.uint8)[::4096].min() == 7
        finally:
            attached.close()
    finally:
        created.close()
        created.unlink()
