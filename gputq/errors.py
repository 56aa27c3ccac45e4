"""gputq's exceptions: the shared tree from ``transport.errors`` plus input errors.

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
