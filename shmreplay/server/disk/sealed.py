"""A checkpoint's files: each made in its directory ``O_CREAT|O_EXCL``
without following a link (``safedir.create_file``), written in parts with
its CRC-32 kept as it goes, then given its mode and group and fsynced
(checkpoint.py has the format and the protocol).  Any thread; one writer
a file.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

from . import safedir


class SealedFile:
    """A new file in a checkpoint's directory, written in parts, its CRC-32
    kept as it goes; when sealed, given its mode and group and fsynced."""

    def __init__(self, dfd: int, name: str):
        self.f = os.fdopen(safedir.create_file(dfd, name), "wb")
        self.crc = self.size = 0

    def write(self, a: np.ndarray) -> None:
        mv = memoryview(np.ascontiguousarray(a)).cast("B")
        self.f.write(mv)
        self.crc = zlib.crc32(mv, self.crc)
        self.size += mv.nbytes

    def seal(self, modes: tuple[int, int]) -> tuple[int, int]:
        """``modes``: (mode, gid); fsync and close; (bytes, crc32)."""
        self.f.flush()
        safedir.set_mode(self.f.fileno(), *modes)
        os.fsync(self.f.fileno())
        self.f.close()
        return self.size, self.crc


def write_file(dfd: int, name: str, arrays, modes: tuple[int, int]) -> tuple[int, int]:
    """Write the arrays' bytes one after another; fsync; (bytes, crc32)."""
    out = SealedFile(dfd, name)
    try:
        for a in arrays:
            out.write(a)
    except BaseException:
        out.f.close()
        raise
    return out.seal(modes)
