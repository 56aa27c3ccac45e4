"""The exception tree shared by every gputq layer.

It lives in the lowest layer (``transport``) because transport servers must
re-raise a unit's errors on the client side by name, and ``transport`` does
not import ``gputq``. ``gputq.errors`` re-exports it and defines the errors
no transport raises; :func:`error_from_wire` rebuilds those too, by name,
in any process that imported ``gputq``.

Every class derives from :class:`GputqError`. Timeouts also derive from
:class:`TimeoutError`, lost peers from :class:`ConnectionError` and bad input
from :class:`ValueError`, so callers can catch either family.
"""

from __future__ import annotations

__all__ = [
    "GputqError",
    "GputqTimeoutError",
    "PeerLostError",
    "ProtocolError",
    "AuthenticationError",
    "TransferError",
    "UnknownKeyError",
    "DuplicateKeyError",
    "CapacityError",
    "RequestTooLargeError",
    "StaleReadError",
    "InvalidInputError",
    "MissingDependencyError",
    "ClosedError",
    "error_to_wire",
    "error_from_wire",
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


class UnknownKeyError(GputqError, KeyError):
    """A key is not (or no longer) stored on the unit asked."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidInputError(GputqError, ValueError):
    """The caller passed something malformed: shape, dtype, range, size."""


class DuplicateKeyError(InvalidInputError):
    """A key was written twice; keys are write-once."""


class RequestTooLargeError(InvalidInputError):
    """A request can never succeed: larger than the arena or the frame limit."""


class CapacityError(GputqTimeoutError):
    """The arena stayed full for the whole put timeout (back-pressure expired)."""


class StaleReadError(GputqError):
    """A read raced a release and could not be served with the right bytes."""


class MissingDependencyError(GputqError, ImportError):
    """An optional dependency (torch, cupy, nixl, ray) is not installed."""


class ClosedError(GputqError):
    """The object was used after ``close()``."""


def _registry() -> dict[str, type[GputqError]]:
    found: dict[str, type[GputqError]] = {}
    stack = [GputqError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


def error_to_wire(exc: BaseException) -> dict:
    """Describe ``exc`` for a peer: its class name (if a gputq error) and message."""
    name = type(exc).__name__ if isinstance(exc, GputqError) else "GputqError"
    message = str(exc) if isinstance(exc, GputqError) else f"{type(exc).__name__}: {exc}"
    return {"error": name, "message": message}


def error_from_wire(payload: dict) -> GputqError:
    """Rebuild the exception a peer described with :func:`error_to_wire`.

    Unknown names (a newer peer) fall back to :class:`GputqError`.
    """
    cls = _registry().get(payload.get("error", ""), GputqError)
    return cls(payload.get("message", ""))
