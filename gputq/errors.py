"""gputq's exceptions: one tree rooted at :class:`GputqError`.

Import errors from here. The root and the errors transports raise
themselves (lost peers, timeouts, protocol and stale-read errors, ...) are
defined in ``transport.errors``, because ``transport`` does not import
``gputq``, and are re-exported here. gputq's own errors are defined here:
those the storage unit answers with (:class:`UnknownKeyError`,
:class:`DuplicateKeyError`, :class:`CapacityError`),
:class:`PartialFailureError` and the errors of the upper layers.

A unit's error crosses the wire by class name: the transport rebuilds it
with :func:`transport.errors.error_from_wire`, which knows every subclass of
:class:`GputqError` defined in the process. Importing this module (as
``gputq``, :mod:`gputq.clients` and everything that talks to units do)
is what lets a client rebuild these with their own class.

Catch :class:`GputqError` for everything; timeouts are also ``TimeoutError``,
lost peers ``ConnectionError`` and bad input ``ValueError``.
"""

from __future__ import annotations

from transport.errors import (
    AuthenticationError,
    ClosedError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    MissingDependencyError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
    StaleReadError,
    TransferError,
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


class UnknownKeyError(GputqError, KeyError):
    """A key is not (or no longer) stored on the unit asked, or its write is not in progress."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateKeyError(InvalidInputError):
    """A key was written twice; keys are write-once."""


class CapacityError(GputqTimeoutError):
    """The arena stayed full for the whole put timeout (back-pressure expired)."""


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
