"""Where a file-backed table's rows file may go (``storage_dir``).

The daemon creates rows files only in directories its config names
(``DaemonConfig.place``), and only once such a directory is one that no
other user can write (``names.secure_dir``): in a directory others can
write, someone could take a rows file's name first or swap the directory's
contents under the daemon.  A missing directory is made 0750, group the
daemon's ``group``, so the clients that may map tables can reach the files.
Runs on the control plane's executor threads.
"""

from __future__ import annotations

import os

from ..errors import ReplayError
from ..wire import names


def prepare_dir(path: str, gid: int = -1) -> str:
    try:
        os.mkdir(path, 0o750)
        os.chown(path, -1, gid)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ReplayError(f"cannot create storage_dir {path}: {exc.strerror}") from None
    return names.secure_dir(path, create=False, purpose="tables' rows files",
                            hint="e.g. StateDirectory= in the unit, mode 0750")
