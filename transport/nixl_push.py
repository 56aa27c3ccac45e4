"""An rdma channel's writes: over tcp, or pushed into their reserved regions with NIXL WRITEs.

Writes take the tcp path below :data:`PUSH_MIN_BYTES` and are pushed
above it: the push copies the payload into a registered staging buffer and
NIXL-WRITEs it into the region reserved by a control call, then commits. It
costs two more control round trips than tcp's single WRITE frame
(``recv_into`` straight into the arena), which loses for small payloads,
but moves large payloads faster on loopback; in the gVisor sandbox of the
GPU host the push lost at every size, so
``GPUTQ_RDMA_WRITE_PATH=tcp`` (or ``write_path``) forces the tcp path
(docs/operations.md has both tables). The unit cannot stop a remote WRITE
into a region it granted, so the client ends its push within
:func:`~gputq.transport.handler.write_window` of the unit's reservation timeout
(from ``nixl_connect``): a push is abandoned, and the write aborted, while
the reservation still holds, and a commit after it expired is refused by
the unit (``UnknownKeyError``).
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from gputq.errors import GputqTimeoutError, InvalidInputError
from gputq.transport.base import byte_view
from gputq.transport.nixl_pool import DRAM
from gputq.transport.nixl_transfer import Transfers
from gputq.transport.reserved_writes import ReservedWrites

__all__ = ["Pushes", "chosen_write_path", "WRITE_PATHS", "PUSH_MIN_BYTES", "PUSH_CHUNK_BYTES", "WRITE_PATH_ENV"]

WRITE_PATHS = ("auto", "tcp", "push")
#: ``write_path="auto"`` pushes payloads of at least this size with NIXL WRITE: below it tcp's
#: one round trip beats the push's two control round trips, above it the push's one-sided copy wins
#: where the fabric does RDMA (docs/operations.md has the measurements).
PUSH_MIN_BYTES = 1 << 20
#: Environment variable choosing the write path of channels built by default.
WRITE_PATH_ENV = "GPUTQ_RDMA_WRITE_PATH"
#: Staging chunk of a push: bounds the registered memory a writer holds.
PUSH_CHUNK_BYTES = 16 << 20


def chosen_write_path(value: str | None) -> str:
    """``value`` checked, or for ``None`` the one :data:`WRITE_PATH_ENV` names (default ``"auto"``).

    Raises
    ------
    InvalidInputError
        Not one of :data:`WRITE_PATHS` (case aside, in the environment).
    """
    if value is None:
        value = os.environ.get(WRITE_PATH_ENV, "").strip().lower() or "auto"
    if value not in WRITE_PATHS:
        raise InvalidInputError(f"write_path must be one of {WRITE_PATHS}, got {value!r}")
    return value


class Pushes:
    """The writes of one rdma channel to its unit.

    Parameters
    ----------
    control:
        The unit's control lane (a :class:`~gputq.transport.tcp.TcpChannel`).
    transfers:
        NIXL transfers to the unit's arena.
    pool:
        The process's registered buffers, to stage a push in.
    arena_nbytes:
        The arena's size: a reservation outside it is a protocol error.
    path:
        ``"auto"``, ``"tcp"`` or ``"push"`` (see :func:`chosen_write_path`).
    """

    def __init__(self, control, transfers: Transfers, pool, arena_nbytes: int, path: str):
        self._control, self._transfers, self._pool, self._path = control, transfers, pool, path
        self.unit = transfers.unit
        self._reserved = ReservedWrites(control, self.unit, arena_nbytes, "push")

    def write(self, key: str, payload, meta: dict | None, timeout: float | None) -> dict:
        """Store ``payload`` under ``key``; the unit's receipt, or its error raised."""
        if not self._pushes(byte_view(payload).nbytes):
            return self._control.write(key, payload, meta, timeout=timeout)
        (result,) = self._reserved.write_many([(key, payload, meta)], timeout, self._push_reserved)
        if isinstance(result, Exception):
            raise result
        return result

    def write_many(self, items: Sequence[tuple], timeout: float | None) -> list:
        """Each ``(key, payload, meta)``'s receipt or error, in order: those that go over tcp in batched
        requests, the pushed ones reserved and committed together."""
        pushes = [self._pushes(byte_view(payload).nbytes) for _, payload, _ in items]
        results: list = [None] * len(items)
        for push in (False, True):
            chosen = [i for i, p in enumerate(pushes) if p is push]
            if not chosen:
                continue
            batch = [items[i] for i in chosen]
            done = self._reserved.write_many(batch, timeout, self._push_reserved) if push \
                else self._control.write_many(batch, timeout)
            for i, result in zip(chosen, done):
                results[i] = result
        return results

    def _pushes(self, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` is pushed with NIXL WRITEs (else it goes over tcp)."""
        return self._path == "push" or (self._path == "auto" and nbytes >= PUSH_MIN_BYTES)

    def _push_reserved(self, key: str, offset: int, data: np.ndarray, deadline: float | None) -> None:
        """A reserved write's move: NIXL WRITEs of ``data`` to ``offset`` through a bounded registered
        staging buffer, none started past ``deadline``."""
        if not data.size:
            return
        chunk = min(data.size, PUSH_CHUNK_BYTES)
        buf = self._pool.acquire(chunk, DRAM)
        try:
            for start in range(0, data.size, chunk):
                if deadline is not None and time.monotonic() > deadline:  # no chunk starts past it
                    raise GputqTimeoutError(f"NIXL WRITE of key {key!r} to unit {self.unit} timed out "
                                            f"after {start} of {data.size} bytes")
                part = data[start:start + chunk]
                np.copyto(buf.obj[:part.size], part)
                self._transfers.run("WRITE", [key], np.array([[offset + start, part.size]], dtype=np.int64),
                                    buf.ptr, DRAM, deadline)
        except BaseException:
            self._pool.discard(buf)
            raise
        self._pool.release(buf)
