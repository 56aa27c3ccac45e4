"""gputq's exceptions: one tree rooted at :class:`GputqError`.

Import errors from here. The root, the transport errors and the errors a
storage unit answers over the wire (``UnknownKeyError``,
``DuplicateKeyError``, ``CapacityError``, ``StaleReadError``) are defined in
``transport.errors``, because transport servers and clients raise and
rebuild them by name and ``transport`` does not import ``gputq``; they are
re-exported here. Errors no transport ever raises are defined here:
:class:`PartialFailureError` and the input errors of the upper layers.

Catch :class:`GputqError` for everything; timeouts are also ``TimeoutError``,
lost peers ``ConnectionError`` and bad input ``ValueError``.
"""

from __future__ import annotations

from transport.errors import (
    AuthenticationError,
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    MissingDependencyError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
    StaleReadError,
    TransferError,
    UnknownKeyError,
)

__all__ = [
    "AuthenticationError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "DuplicateKeyError",
    "FieldValueError",
    "GputqError",
    "GputqTimeoutError",
    "InvalidInputError",
    "LayoutError",
    "MissingDependencyError",
    "PartialFailureError",
    "PeerLostError",
    "ProtocolError",
    "RequestTooLargeError",
    "StaleReadError",
    "TransferError",
    "UnitLostError",
    "UnitTimeoutError",
    "UnknownKeyError",
]


class PartialFailureError(GputqError):
    """A fan-out finished on some peers and not on others.

    Raised only after the reachable peers were served; ``result`` holds
    what was done and what failed (e.g. ``{"freed": int, "unreachable":
    {unit: reason}}`` for a partition release).
    """

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result


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
