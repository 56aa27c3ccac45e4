"""Writes of several keys in one request, as a unit serves them.

Two requests carry many writes at once: the tcp ``WRITE_MANY`` frame (the
payloads follow the body) and, for a writer on the unit's host, the
reservation calls (the writer copies into the arena file itself):

1. :data:`RESERVE_WRITES` reserves a region for each ``[key, nbytes,
   meta]`` item and answers each one's ``offset`` (or ``error``), and the
   unit's ``reservation_s``: a region is the writer's that long;
2. the writer copies each payload to its offset, within
   :func:`~gputq.transport.handler.write_window` of ``reservation_s``
   counted from the reply (the unit cannot stop a copy into its arena
   once the reservation is gone, and the region may be another key's);
3. :data:`COMMIT_WRITES` makes each ``[key, generation]`` readable and
   answers its ``receipt`` (or ``error``); :data:`ABORT_WRITES` gives the
   regions of a batch that failed back.

Both follow one rule for a full arena: once a write of the request finds
no space (``CapacityError``, after waiting up to the request's
``timeout``), the later ones are refused at once with the same class. They
would each wait for the space the first did not get; the writer then asks
before its next request whether the unit has room again.
"""

from __future__ import annotations

import logging
import time

from gputq.errors import CapacityError, GputqError, InvalidInputError, TransferError
from gputq.transport.base import byte_view
from gputq.transport.handler import ArenaHandler
from gputq.transport.wire import MAX_WRITE_ITEMS, error_to_wire

__all__ = ["RESERVE_WRITES", "COMMIT_WRITES", "ABORT_WRITES", "write_item", "write_items", "typed_error",
           "FullArena", "reservation_call", "reserve", "generation_of"]

log = logging.getLogger(__name__)

#: Control methods every tcp server answers for a writer on the unit's host.
RESERVE_WRITES, COMMIT_WRITES, ABORT_WRITES = "reserve_writes", "commit_writes", "abort_writes"


def write_item(key, nbytes, meta, timeout=None) -> tuple[str, int, dict, float | None]:
    """One write's checked fields (``InvalidInputError`` naming what is wrong)."""
    meta = meta or {}
    if not isinstance(key, str) or type(nbytes) is not int or nbytes < 0 or not isinstance(meta, dict) \
            or not (timeout is None or (isinstance(timeout, (int, float)) and timeout >= 0)):
        raise InvalidInputError("a write needs key (str), nbytes (int >= 0), meta (map) and timeout (number >= 0)")
    return key, nbytes, meta, timeout


def write_items(items, timeout=None) -> list[tuple[str, int, dict]]:
    """A request's checked ``[key, nbytes, meta]`` items (1 to :data:`MAX_WRITE_ITEMS` of them)."""
    if not isinstance(items, list) or not 0 < len(items) <= MAX_WRITE_ITEMS:
        raise InvalidInputError(f"a batch of writes needs items: a list of 1 to {MAX_WRITE_ITEMS} "
                                f"[key, nbytes, meta]")
    if not all(isinstance(item, list) and len(item) == 3 for item in items):
        raise InvalidInputError("each item of a batch of writes is [key, nbytes, meta]")
    return [write_item(key, nbytes, meta, timeout)[:3] for key, nbytes, meta in items]


def typed_error(exc: Exception, handler: ArenaHandler) -> Exception:
    """What a peer is told about ``exc``: a typed error, whatever the handler raised."""
    if isinstance(exc, GputqError):
        return exc
    if isinstance(exc, (TypeError, KeyError, ValueError, AttributeError, IndexError, OverflowError)):
        return InvalidInputError(f"unit {handler.name}: malformed request: {type(exc).__name__}: {exc}")
    log.error("unit %s: handler failed", handler.name, exc_info=exc)
    return exc


class FullArena:
    """The full-arena rule of one request: its deadline for waits, and the first ``CapacityError``."""

    def __init__(self, handler: ArenaHandler, timeout: float | None):
        self._name = handler.name
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.error: CapacityError | None = None

    def left(self) -> float | None:
        """What is left of the request's timeout for the next write's wait."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def refusal(self, key: str, nbytes: int) -> CapacityError | None:
        """The error a write after the first full one gets, or None before it."""
        if self.error is None:
            return None
        return CapacityError(f"unit {self._name}: no space for key {key!r} ({nbytes} bytes): an earlier write "
                             f"of the same request found the arena full ({self.error})")

    def saw(self, result) -> None:
        if self.error is None and isinstance(result, CapacityError):
            self.error = result


def reserve(handler: ArenaHandler, key: str, nbytes: int, meta: dict, wait_s: float | None) -> int:
    """``handler.begin_write``, its region checked to lie inside the arena (else aborted: ``TransferError``)."""
    offset = handler.begin_write(key, nbytes, meta, wait_s)
    if offset < 0 or offset + nbytes > byte_view(handler.arena).nbytes:
        handler.abort_write(key, generation_of(meta))
        raise TransferError(f"unit {handler.name} reserved [{offset}, {offset + nbytes}) outside its arena",
                            handler.name, (key,))
    return offset


def generation_of(meta: dict) -> int | None:
    """The generation a write's ``meta`` names its reservation by (commit and abort name that reservation,
    not a later one of the same key), or None."""
    value = meta.get("generation")
    return value if type(value) is int else None


def _named(items, what: str) -> list[tuple[str, int | None]]:
    if not isinstance(items, list) or not 0 < len(items) <= MAX_WRITE_ITEMS \
            or not all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], str) for i in items):
        raise InvalidInputError(f"{what} needs items: a list of 1 to {MAX_WRITE_ITEMS} [key, generation]")
    return [(key, generation if type(generation) is int else None) for key, generation in items]


def reservation_call(handler: ArenaHandler, method: str, args: dict):
    """Answer :data:`RESERVE_WRITES`, :data:`COMMIT_WRITES` or :data:`ABORT_WRITES`; ``NotImplemented`` for
    any other method."""
    if method == RESERVE_WRITES:
        wait_s = args.get("wait_s")
        items = write_items(args.get("items"), wait_s)
        full, results = FullArena(handler, wait_s), []
        for key, nbytes, meta in items:
            result = full.refusal(key, nbytes)
            if result is None:
                try:
                    result = {"offset": reserve(handler, key, nbytes, meta, full.left())}
                except Exception as exc:
                    result = typed_error(exc, handler)
                    full.saw(result)
            results.append({"error": error_to_wire(result)} if isinstance(result, Exception) else result)
        return {"results": results, "reservation_s": handler.reservation_timeout_s}
    if method == COMMIT_WRITES:
        results = []
        for key, generation in _named(args.get("items"), COMMIT_WRITES):
            try:
                results.append({"receipt": handler.commit_write(key, generation)})
            except Exception as exc:
                results.append({"error": error_to_wire(typed_error(exc, handler))})
        return {"results": results}
    if method == ABORT_WRITES:
        for key, generation in _named(args.get("items"), ABORT_WRITES):
            try:
                handler.abort_write(key, generation)
            except Exception as exc:  # one region not given back must not keep the others
                log.debug("unit %s: abort of %r failed: %s", handler.name, key, exc)
        return None
    return NotImplemented
