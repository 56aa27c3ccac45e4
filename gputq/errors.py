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
    "PeerLostError",
    "ProtocolError",
    "RequestTooLargeError",
    "StaleReadError",
    "TransferError",
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
