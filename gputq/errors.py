"""gputq's exceptions: one tree rooted at :class:`GputqError`, in this one module.

Every error gputq raises on purpose derives from :class:`GputqError`.
Timeouts also derive from :class:`TimeoutError`, lost peers from
:class:`ConnectionError` and bad input from :class:`ValueError`, so callers
can catch either family.

The module sits below every other layer (the transports raise these errors
too) and imports no other module of gputq. A unit's error crosses the wire by class name:
:func:`gputq.transport.wire.error_from_wire` rebuilds it with its own class
from the subclasses of :class:`GputqError` defined here.
"""

from __future__ import annotations

import logging
import sys

__all__ = [
    "AuthenticationError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "DuplicateKeyError",
    "FieldValueError",
    "GputqError",
    "GputqTimeoutError",
    "HintMissedError",
    "InvalidInputError",
    "LayoutError",
    "LeaseExpiredError",
    "MissingDependencyError",
    "PartialFailureError",
    "PeerLostError",
    "PlanError",
    "ProtocolError",
    "RequestTooLargeError",
    "StaleReadError",
    "TransferError",
    "TransferSetupError",
    "UnitBusyError",
    "UnitLostError",
    "UnitTimeoutError",
    "UnknownKeyError",
]


class GputqError(Exception):
    """Root of every error gputq raises on purpose."""


class GputqTimeoutError(GputqError, TimeoutError):
    """An operation did not complete within its timeout."""


class PeerLostError(GputqError, ConnectionError):
    """The remote side closed the connection or stopped answering."""


class ProtocolError(GputqError, ConnectionError):
    """A frame violated the wire protocol (bad magic, truncated, oversized)."""


class AuthenticationError(GputqError, PermissionError):
    """The shared-token handshake failed."""


class TransferError(GputqError):
    """A data transfer failed; the message names the unit and the keys."""

    def __init__(self, message: str, unit: str | None = None, keys=()):
        super().__init__(message)
        self.unit = unit
        self.keys = tuple(keys)


class InvalidInputError(GputqError, ValueError):
    """The caller passed something malformed: shape, dtype, range, size."""


class PlanError(InvalidInputError):
    """A plan or a buffer handed to the widen+scatter kernel (:mod:`gputq.kernels`) is invalid."""


class RequestTooLargeError(InvalidInputError):
    """A request can never succeed: larger than the arena or the frame limit."""


class StaleReadError(GputqError):
    """A read raced a release and could not be served with the right bytes."""


class TransferSetupError(TransferError):
    """The transfer library refused to set a transfer up (NIXL ``initialize_xfer``): nothing moved.

    Another lane may work: an rdma read into device memory that gets it
    goes through host memory instead.
    """


class LeaseExpiredError(StaleReadError):
    """A one-sided read's lease expired before its copy finished (its reader stalled past the lease's lifetime).

    What the copy read may belong to other keys and is not returned; a read
    under a new lease gets the right bytes, or the keys' own error.
    """


class HintMissedError(StaleReadError):
    """A same-host read ran on the unit's key directory, and the lease named other regions.

    What the block read may belong to other keys; reading again after the
    lease (``ahead=False``) gets the right bytes.
    """


class MissingDependencyError(GputqError, ImportError):
    """An optional dependency (torch, cupy, nixl, ray) is not installed."""


class ClosedError(GputqError):
    """The object was used after ``close()``."""


class UnknownKeyError(GputqError, KeyError):
    """A key is not (or no longer) stored on the unit asked, or its write is not in progress."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateKeyError(InvalidInputError):
    """A key was written twice; keys are write-once."""


class CapacityError(GputqTimeoutError):
    """The arena stayed full for the whole put timeout (back-pressure expired)."""


class UnitBusyError(GputqTimeoutError):
    """A request found no connection for its whole timeout, and was not sent.

    Either the unit refused connections (it held ``max_connections``, all
    authenticated; a client retries a refused connection with backoff within
    its timeout), or every connection of the client's own capped pool stayed
    in use by other requests. The unit is not implicated: this error does not
    mark it lost.
    """


class FieldValueError(InvalidInputError):
    """A field's array cannot be stored as given: shape, dtype, range or NaN.

    The message names the key, the field and, for range errors, the value.
    """


class LayoutError(InvalidInputError):
    """A layout or fragment is out of bounds, overlaps, or mixes fields."""


class ConfigError(InvalidInputError):
    """A configuration value is missing, malformed or inconsistent."""


class PartialFailureError(GputqError):
    """A fan-out call reached some units but not all; ``result`` holds what was done.

    Raised only after every reachable unit has been served, so the work
    that could be done is done; ``result["unreachable"]`` names the units
    that were not, with the reason.
    """

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result

    def __reduce__(self):  # keep ``result`` across pickling (Ray actors)
        return type(self), (str(self), self.result)


class UnitLostError(PeerLostError):
    """A unit stopped answering and is marked lost; names the unit and the keys asked for.

    Requests to a lost unit fail at once with this error until a probe
    reaches the unit again. ``unit``, ``keys`` and ``reason`` (the first
    failure) are attributes.
    """

    def __init__(self, message: str, unit: str | None = None, keys=(), reason: str = ""):
        super().__init__(message)
        self.unit = unit
        self.keys = tuple(keys)
        self.reason = reason

    def __reduce__(self):
        return type(self), (str(self), self.unit, self.keys, self.reason)


class UnitTimeoutError(UnitLostError, GputqTimeoutError):
    """The request that found a unit hung: it timed out, and the unit is now marked lost."""


#: Whether exceptions take notes themselves (Python 3.11 on).
_NATIVE_NOTES = sys.version_info >= (3, 11)


def add_note(exc: BaseException, note: str) -> None:
    """Say ``note`` with ``exc`` as ``exc.add_note`` does (not part of the tree: gputq's own use).

    Python 3.10 has no ``add_note``, and its tracebacks show no notes: the
    note is kept in ``exc.__notes__`` all the same, and logged, so that what
    went wrong beside the exception raised is not lost there.
    """
    if _NATIVE_NOTES:
        exc.add_note(note)
        return
    exc.__notes__ = [*getattr(exc, "__notes__", ()), note]
    logging.getLogger("gputq").warning("%s: %s", type(exc).__name__, note)
