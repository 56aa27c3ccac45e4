"""The root of the gputq exception tree and the errors transports raise.

It lives in the lowest layer (``transport``) because transports raise these
errors themselves and ``transport`` does not import ``gputq``. The storage
unit's own errors (``UnknownKeyError``, ``DuplicateKeyError``,
``CapacityError``, ...) are defined in ``gputq.errors``, which re-exports
this module. A transport server sends any handler error by class name
(:func:`error_to_wire`); :func:`error_from_wire` rebuilds it from every
subclass of :class:`GputqError` defined so far, so a client rebuilds the
unit's errors with their own class in any process that imported
``gputq.errors``, and as plain :class:`GputqError` in one that did not.

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
    "RequestTooLargeError",
    "StaleReadError",
    "HintMissedError",
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


class InvalidInputError(GputqError, ValueError):
    """The caller passed something malformed: shape, dtype, range, size."""


class RequestTooLargeError(InvalidInputError):
    """A request can never succeed: larger than the arena or the frame limit."""


class StaleReadError(GputqError):
    """A read raced a release and could not be served with the right bytes."""


class HintMissedError(StaleReadError):
    """A same-host read ran on the unit's key directory, and the lease named other regions.

    What the block read may belong to other keys; reading again after the
    lease (``ahead=False``) gets the right bytes.
    """


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

    Names of classes not defined in this process (a newer peer, or a
    unit's error where ``gputq.errors`` was never imported) fall back to
    :class:`GputqError`.
    """
    cls = _registry().get(payload.get("error", ""), GputqError)
    return cls(payload.get("message", ""))
