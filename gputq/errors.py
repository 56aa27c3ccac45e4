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
