"""Whether the machine can hold a table: its segments and the daemon's own
arrays for it, against the memory the kernel says is available.  Called by
the control plane before it creates or restores a table."""

from __future__ import annotations

from ...errors import CapacityError
from ...wire.layout import TableLayout
from ...wire.segment import shm_free_bytes
from ..tables.table import private_bytes


def check_memory(spec) -> None:
    """Refuse a table the machine cannot hold: its segments plus what the
    daemon allocates beside them (``table.private_bytes``), against the
    memory the kernel says is available now.  A file-backed table's rows
    are on disk (``RowFile.create`` checks the room there), not counted."""
    layout = TableLayout(spec)
    segments = layout.size + (0 if spec.file_backed else layout.rows_size)
    private = private_bytes(spec)
    shm = shm_free_bytes()
    if shm is not None and segments > shm:
        return  # /dev/shm itself is too small: Segment.create says so (ShmFull), with the sizes
    avail = mem_available()
    if avail is not None and segments + private > avail:
        raise CapacityError(
            f"table {spec.name!r} needs {(segments + private) / 2**20:.1f} MiB ({segments / 2**20:.1f} "
            f"in shared memory, {private / 2**20:.1f} in the daemon) but only {avail / 2**20:.1f} MiB "
            "of memory is available")


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
