"""Writes whose bytes the writer moves itself into regions its unit reserved: reserve, move, commit.

Two channels move a write's bytes without the unit's threads: a writer on
the unit's host copies them into the arena file, mapped writable (shm), and
an rdma writer pushes them with NIXL WRITEs. Both speak the same protocol
over the unit's control lane (:mod:`gputq.transport.write_batches`), a
whole batch at a time:

1. :data:`~gputq.transport.write_batches.RESERVE_WRITES` reserves a region
   for every write of the batch (one round trip);
2. the channel moves each payload to its region (:class:`ReservedWrites`'
   ``move``);
3. :data:`~gputq.transport.write_batches.COMMIT_WRITES` makes them readable
   (one more round trip), each under the writer's generation; a write the
   unit refused (a full arena, a key written already) is that item's error.

The unit cannot stop a copy or a WRITE into its arena, and once a
reservation expires its region may hold another key. So no move starts or
goes on past :func:`~gputq.transport.handler.write_window` of the unit's
reservation lifetime (half of it), counted from when the
reservation was *requested* (the unit granted it later); a batch that would
is given back (:data:`~gputq.transport.write_batches.ABORT_WRITES`) while
its reservations hold, and raises ``GputqTimeoutError``.

:class:`ArenaFileWrites` is the same-host writer's side: its move is one
copy into the unit's arena file, mapped writable on first use.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from gputq.errors import GputqTimeoutError, ProtocolError
from gputq.transport.arena_mapping import ArenaMapping
from gputq.transport.base import byte_view, describe_keys
from gputq.transport.handler import write_window
from gputq.transport.lease_ends import stated_seconds
from gputq.transport.wire import error_from_wire
from gputq.transport.write_batches import ABORT_WRITES, COMMIT_WRITES, RESERVE_WRITES, generation_of

__all__ = ["ReservedWrites", "ArenaFileWrites", "REPLY_GRACE_S"]

_log = logging.getLogger(__name__)

#: Seconds a reservation's reply may take beyond the request's own wait for space; and what a
#: commit or an abort may take when the write's timeout is spent (a moved batch must get committed).
REPLY_GRACE_S = 10.0

#: ``move(key, offset, data, deadline)``: put ``data`` (uint8) at ``offset`` of the arena, raising
#: ``GputqTimeoutError`` rather than moving a byte after ``deadline`` (``time.monotonic``; None: unbounded).
Move = Callable[[str, int, np.ndarray, "float | None"], None]


class ReservedWrites:
    """The reserve-move-commit writes of one channel to its unit.

    Parameters
    ----------
    control:
        The unit's control lane (a :class:`~gputq.transport.tcp.TcpChannel`: ``request``).
    unit:
        The unit's name, for messages.
    arena_nbytes:
        The arena's size: a reservation outside it is a protocol error.
    verb:
        What a move is called in messages ("copy", "push").
    """

    def __init__(self, control, unit: str, arena_nbytes: int, verb: str):
        self._control = control
        self.unit = unit
        self._arena_nbytes = int(arena_nbytes)
        self._verb = verb

    def write_many(self, items: Sequence[tuple], timeout: float | None, move: Move) -> list:
        """Store ``(key, payload, meta)`` items: each one's receipt or the unit's error for it, in order
        (see :meth:`Channel.write_many <gputq.transport.base.Channel.write_many>`)."""
        keys = [key for key, _, _ in items]
        views = [np.frombuffer(byte_view(payload), np.uint8) for _, payload, _ in items]
        metas = [meta or {} for _, _, meta in items]
        asked = time.monotonic()
        reply = self._control.request(
            RESERVE_WRITES, {"items": [[k, v.nbytes, m] for k, v, m in zip(keys, views, metas)], "wait_s": timeout},
            None if timeout is None else timeout + REPLY_GRACE_S, keys=keys, write=True)
        results, reserved = self._reserved(reply, keys, views)
        if not reserved:
            return results
        named = [[keys[i], generation_of(metas[i])] for i, _ in reserved]
        reservation_s = reply.get("reservation_s")
        if reservation_s is not None and stated_seconds(reservation_s) is None:
            raise ProtocolError(f"unit {self.unit}: {RESERVE_WRITES} states a reservation lifetime of "
                                f"{reservation_s!r}; writes of {describe_keys(keys)} not made")
        window = write_window(reservation_s)
        try:
            for i, offset in reserved:
                self._move(move, keys[i], offset, views[i], None if window is None else asked + window, window)
        except BaseException:
            with contextlib.suppress(Exception):  # the move's error is the one to see
                self._control.request(ABORT_WRITES, {"items": named}, REPLY_GRACE_S, keys=keys, write=True)
            raise
        done = self._control.request(COMMIT_WRITES, {"items": named}, None if timeout is None else REPLY_GRACE_S,
                                     keys=keys, write=True)
        committed = done.get("results") if isinstance(done, dict) else None
        if not _results(committed, len(reserved), "receipt"):
            raise ProtocolError(f"unit {self.unit}: malformed {COMMIT_WRITES} reply for keys {describe_keys(keys)}")
        for (i, _), result in zip(reserved, committed):
            results[i] = error_from_wire(result["error"]) if "error" in result else result["receipt"]
        return results

    def _move(self, move: Move, key: str, offset: int, data: np.ndarray, deadline: float | None,
              window: float | None) -> None:
        """One move, never started past ``deadline``; a late one raises naming the window."""
        try:
            if deadline is not None and time.monotonic() > deadline:
                raise GputqTimeoutError(f"it would start {time.monotonic() - deadline:.3g} s past it")
            move(key, offset, data, deadline)
        except GputqTimeoutError as exc:
            raise GputqTimeoutError(f"unit {self.unit}: {self._verb} of key {key!r} ({data.nbytes} bytes) not done "
                                    f"within {window:g} s of its reservation's request (half the unit's "
                                    f"reservation): {exc}; write aborted") from None

    def _reserved(self, reply, keys: list, views: list) -> tuple[list, list[tuple[int, int]]]:
        """The reservation reply's errors in place, and ``(item, offset)`` of every region reserved."""
        answers = reply.get("results") if isinstance(reply, dict) else None
        if not _results(answers, len(keys), "offset"):
            raise ProtocolError(f"unit {self.unit}: malformed {RESERVE_WRITES} reply for keys {describe_keys(keys)}")
        results: list = [None] * len(keys)
        reserved = []
        for i, answer in enumerate(answers):
            if "error" in answer:
                results[i] = error_from_wire(answer["error"])
                continue
            offset = answer["offset"]
            if type(offset) is not int or offset < 0 or offset + views[i].nbytes > self._arena_nbytes:
                raise ProtocolError(f"unit {self.unit} reserved {offset!r} for {views[i].nbytes} bytes of "
                                    f"{keys[i]!r}, outside its arena of {self._arena_nbytes}")
            reserved.append((i, offset))
        return results, reserved


class ArenaFileWrites:
    """A same-host writer's writes to one unit, copied straight into its arena file (mapped writable on first
    use); over the control lane where the file cannot be mapped so.

    Parameters
    ----------
    control:
        The unit's control lane (a :class:`~gputq.transport.tcp.TcpChannel`).
    unit:
        The unit's name.
    path, nbytes:
        The arena file, and its size.

    Attributes
    ----------
    fallback_reason : str or None
        Why writes go over the control lane, once mapping the file writable failed.
    copied : int
        Writes copied into the arena.
    """

    def __init__(self, control, unit: str, path: str, nbytes: int):
        self._control, self.unit, self._path, self._nbytes = control, unit, path, int(nbytes)
        self._writes = ReservedWrites(control, unit, nbytes, "copy")
        self._lock = threading.Lock()
        self._mapping: ArenaMapping | None = None
        self._closed = False
        self.fallback_reason: str | None = None
        self.copied = 0

    def write_many(self, items: Sequence[tuple], timeout: float | None) -> list:
        """Store ``(key, payload, meta)`` items, as :meth:`ReservedWrites.write_many` does."""
        if self._writable() is None:
            return self._control.write_many(items, timeout)
        return self._writes.write_many(items, timeout, self._copy_in)

    def _writable(self) -> ArenaMapping | None:
        """The arena mapped writable, on first use; None where that failed (then tried no more)."""
        with self._lock:
            if self._mapping is None and self.fallback_reason is None and not self._closed:
                try:
                    self._mapping = ArenaMapping(self._path, self._nbytes, writable=True)
                except OSError as exc:
                    self.fallback_reason = f"cannot map the arena file of unit {self.unit} writable: {exc}"
                    _log.warning("writes to unit %s go over tcp: %s", self.unit, self.fallback_reason)
            return self._mapping

    def _copy_in(self, key: str, offset: int, data: np.ndarray, deadline: float | None) -> None:
        """A reserved write's move: one copy into the writable mapping (started inside its window)."""
        with self._mapping.held() as mapping:
            np.copyto(mapping.array[offset:offset + data.nbytes], data)
        with self._lock:
            self.copied += 1

    def close(self) -> None:
        """Unmap the arena file (once the copies into it are done). Idempotent."""
        with self._lock:
            mapping, self._mapping, self._closed = self._mapping, None, True
        if mapping is not None:
            mapping.close()


def _results(answers, count: int, ok: str) -> bool:
    return isinstance(answers, list) and len(answers) == count and \
        all(isinstance(a, dict) and (ok in a or "error" in a) for a in answers)
