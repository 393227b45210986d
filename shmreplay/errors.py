"""Exception hierarchy.

Every error a client can see is a ``ReplayError``.  Each class carries a
stable ``code`` so that the daemon can send it over either wire (control
frames carry the class name, command-ring responses carry the integer code)
and the client can raise the same class on its side.  Shared by both
wings; no state, any thread.
"""

from __future__ import annotations


class ReplayError(Exception):
    """Base class of every shmreplay error."""

    code = 1


class ProtocolError(ReplayError):
    """A peer sent a frame or record that breaks the protocol."""

    code = 2


class DaemonUnavailable(ReplayError):
    """The daemon is not running, went away, or refused the connection."""

    code = 3


class ReplayTimeout(ReplayError, TimeoutError):
    """A wait for the daemon ran past its timeout."""

    code = 4


class UnknownTable(ReplayError, KeyError):
    """No table with that name (or id) exists."""

    code = 5

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TableExists(ReplayError):
    """A table with that name exists already (with a different schema)."""

    code = 6


class SchemaError(ReplayError, ValueError):
    """A table definition is invalid (bad name, dtype, shape, capacity ...)."""

    code = 7


class FieldError(ReplayError, ValueError):
    """Data does not fit the table: missing or unknown field, wrong dtype or shape."""

    code = 8


class PriorityError(ReplayError, ValueError):
    """A priority is NaN, infinite or negative, or the count does not match."""

    code = 9


class CapacityError(ReplayError):
    """The request cannot fit: table full of reservations, batch too large."""

    code = 10


class ShmFull(ReplayError, OSError):
    """Shared memory (/dev/shm) has no room for the requested segment."""

    code = 11


class DiskFull(ShmFull):
    """The filesystem of a table's ``storage_dir`` has no room for its rows
    file (a ShmFull too: code that handles "no room for this table" handles
    both)."""

    code = 18


class LayoutError(ReplayError):
    """A segment's magic, layout version or schema is not what was expected."""

    code = 12


class ForeignObject(LayoutError):
    """A shared object or file the daemon would use is not one it made: a
    symlink, a FIFO, another user's, or a mode it never sets."""

    code = 17


class RateLimited(ReplayTimeout):
    """An insert or sample waited past its timeout for the table's limits
    (rate limiter, min_size_to_sample, reuse limits, all slots taken)."""

    code = 14


class EmptyTable(RateLimited):
    """A sample found nothing sampleable (and could not wait, or waited in vain)."""

    code = 13


class SlotsBusy(RateLimited, CapacityError):
    """An insert waited past its timeout because every slot was reserved by
    writers or held by learners still reading their last sample.  A wait
    like any other (a client with no timeout keeps waiting), and a
    CapacityError for code that catches that."""

    code = 16


class ReservationExpired(ReplayError):
    """A writer's commit came after its reservation expired
    (``reservation_timeout_s``): those items were not stored.  Reported by
    the writer's next call or ``flush()``; nothing else is affected."""

    code = 19


class PermissionDenied(ReplayError, PermissionError):
    """The daemon's access rules refuse this user (connect) or this
    operation (admin operations: drop_table, checkpoint, shutdown; writes to
    a table only its creator writes: ``writers="creator"``); or an inference
    channel is another user's (its envs run as its learner's user)."""

    code = 15


class InferenceClosed(ReplayError):
    """An inference channel's other side is gone: its server closed it or
    died (an env's call, or its attach), or this handle was closed."""

    code = 20


_BY_CODE = {
    cls.code: cls
    for cls in (
        ReplayError, ProtocolError, DaemonUnavailable, ReplayTimeout, UnknownTable,
        TableExists, SchemaError, PermissionDenied, FieldError, PriorityError, CapacityError, ShmFull,
        LayoutError, EmptyTable, RateLimited, SlotsBusy, ForeignObject, DiskFull, ReservationExpired,
        InferenceClosed,
    )
}
_BY_NAME = {cls.__name__: cls for cls in _BY_CODE.values()}


def error_from_code(code: int, message: str) -> ReplayError:
    """Rebuild a daemon-side error on the client (unknown codes -> ReplayError)."""
    return _BY_CODE.get(int(code), ReplayError)(message)


def error_from_name(name: str, message: str) -> ReplayError:
    return _BY_NAME.get(str(name), ReplayError)(message)
