"""Test doubles for transport tests: an in-memory arena handler and fake sockets.

:class:`DictArenaHandler` implements :class:`transport.base.ArenaHandler`
over a ``bytearray`` with a first-fit allocator, write-once keys, leases and
the control methods ``stats`` and ``release``. Any backend's tests (tcp,
NIXL) can serve it. :class:`FakeSocket` is an in-memory socket pair for
driving :mod:`transport.wire` without the network.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from typing import Sequence

from transport.base import Lease, Region
from transport.errors import (
    CapacityError,
    DuplicateKeyError,
    InvalidInputError,
    RequestTooLargeError,
    UnknownKeyError,
)

__all__ = ["DictArenaHandler", "FakeSocket"]


class DictArenaHandler:
    """An in-memory arena with a key table, for serving in tests.

    Parameters
    ----------
    capacity
        Arena size in bytes.
    name
        The unit name reported to clients.
    buffer
        Optional writable buffer to use as the arena instead of a fresh
        ``bytearray`` (e.g. pinned or registered memory for NIXL tests).

    Notes
    -----
    Keys are write-once: ``begin_write`` reserves (pending), ``commit_write``
    publishes, ``abort_write`` drops a reservation. ``release`` of a leased
    key hides it at once and frees its bytes when the last lease ends.
    Each allocation gets a new generation number. ``calls`` counts every
    handler call by name, for assertions.
    """

    def __init__(self, capacity: int = 64 << 20, name: str = "unit-0", buffer=None):
        self.name = name
        self._buf = bytearray(capacity) if buffer is None else buffer
        self._arena = memoryview(self._buf).cast("B")
        self.capacity = self._arena.nbytes
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[int, int, int]] = {}
        self._committed: dict[str, tuple[int, int, int]] = {}
        self._meta: dict[str, dict] = {}
        self._pins: dict[str, int] = {}
        self._released: set[str] = set()  # hidden, freed when unpinned
        self._leases: dict[int, tuple[str, ...]] = {}
        self._lease_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self.calls: dict[str, int] = {}

    @property
    def arena(self) -> memoryview:
        return self._arena

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    # first-fit allocator over a sorted free list
    def _alloc(self, nbytes: int) -> int | None:
        if nbytes == 0:
            return 0
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (offset + nbytes, size - nbytes)
                return offset
        return None

    def _dealloc(self, offset: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        self._free.append((offset, nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((off, size))
        self._free = merged
        self._cond.notify_all()

    def used_bytes(self) -> int:
        with self._cond:
            return self.capacity - sum(size for _, size in self._free)

    def begin_write(self, key: str, nbytes: int, meta: dict, timeout: float | None) -> int:
        self._count("begin_write")
        if nbytes < 0:
            raise InvalidInputError(f"negative size {nbytes} for key {key!r}")
        if nbytes > self.capacity:
            raise RequestTooLargeError(f"key {key!r}: {nbytes} bytes can never fit a {self.capacity}-byte arena")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if key in self._pending or key in self._committed:
                raise DuplicateKeyError(f"key {key!r} already written on {self.name}")
            while (offset := self._alloc(nbytes)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CapacityError(f"{self.name} stayed full for {timeout} s writing {key!r}")
                self._cond.wait(left)
            self._pending[key] = (offset, nbytes, next(self._generations))
            self._meta[key] = dict(meta)
            return offset

    def commit_write(self, key: str) -> dict:
        self._count("commit_write")
        with self._cond:
            if key not in self._pending:
                raise UnknownKeyError(f"no pending write for key {key!r} on {self.name}")
            offset, nbytes, generation = self._committed[key] = self._pending.pop(key)
            return {"unit": self.name, "key": key, "offset": offset, "nbytes": nbytes, "generation": generation}

    def abort_write(self, key: str) -> None:
        self._count("abort_write")
        with self._cond:
            entry = self._pending.pop(key, None)
            self._meta.pop(key, None)
            if entry is not None:
                self._dealloc(entry[0], entry[1])

    def lease(self, keys: Sequence[str]) -> Lease:
        self._count("lease")
        with self._cond:
            missing = [k for k in keys if k not in self._committed or k in self._released]
            if missing:
                raise UnknownKeyError(f"unknown key {missing[0]!r} on {self.name}")
            entries = [self._committed[k] for k in keys]
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = tuple(keys)
            return Lease(lease_id, tuple(Region(o, n) for o, n, _ in entries), tuple(g for _, _, g in entries))

    def end_lease(self, lease_id: int) -> None:
        self._count("end_lease")
        with self._cond:
            for key in self._leases.pop(lease_id, ()):
                self._pins[key] -= 1
                if self._pins[key] == 0:
                    del self._pins[key]
                    if key in self._released:
                        self._free_key(key)

    def _free_key(self, key: str) -> None:
        offset, nbytes, _ = self._committed.pop(key)
        self._meta.pop(key, None)
        self._released.discard(key)
        self._dealloc(offset, nbytes)

    def active_leases(self) -> int:
        with self._cond:
            return len(self._leases)

    def control(self, method: str, args: dict):
        self._count("control")
        if method == "stats":
            with self._cond:
                return {"unit": self.name, "capacity": self.capacity,
                        "used": self.capacity - sum(size for _, size in self._free),
                        "keys": len(self._committed) - len(self._released),
                        "pending": len(self._pending), "leases": len(self._leases)}
        if method == "release":
            released = 0
            with self._cond:
                for key in args.get("keys", ()):
                    if key not in self._committed or key in self._released:
                        continue
                    released += 1
                    if self._pins.get(key):
                        self._released.add(key)
                    else:
                        self._free_key(key)
            return {"released": released}
        raise InvalidInputError(f"unknown control method {method!r}")


class FakeSocket:
    """One end of an in-memory, stream-oriented socket pair.

    ``sendall`` appends to the peer's inbound buffer; ``recv_into`` blocks
    until data arrives, the peer closes (returns 0) or the timeout set with
    ``settimeout`` expires (raises ``socket.timeout``). :meth:`load` injects
    crafted bytes and :meth:`feed_eof` simulates the peer closing.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._inbox = bytearray()
        self._eof = False
        self.closed = False
        self.peer: FakeSocket | None = None
        self._timeout: float | None = None
        self.sent = bytearray()  # everything this end sent, for inspection

    @classmethod
    def pair(cls) -> tuple["FakeSocket", "FakeSocket"]:
        a, b = cls(), cls()
        a.peer, b.peer = b, a
        return a, b

    def load(self, data: bytes) -> None:
        """Append ``data`` to what this end will receive."""
        with self._cond:
            self._inbox += data
            self._cond.notify_all()

    def feed_eof(self) -> None:
        """Make receives return 0 once the buffered data is consumed."""
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def sendall(self, data) -> None:
        if self.closed:
            raise OSError("send on a closed FakeSocket")
        if self.peer is not None and self.peer.closed:
            raise BrokenPipeError("peer closed")
        data = bytes(data)
        self.sent += data
        if self.peer is not None:
            self.peer.load(data)

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        want = nbytes or view.nbytes
        with self._cond:
            ok = self._cond.wait_for(lambda: self._inbox or self._eof or self.closed, self._timeout)
            if self.closed:
                raise OSError("recv on a closed FakeSocket")
            if not ok:
                raise socket.timeout("timed out")
            n = min(want, len(self._inbox))
            view[:n] = self._inbox[:n]
            del self._inbox[:n]
            return n

    def recv(self, bufsize: int) -> bytes:
        buf = bytearray(bufsize)
        n = self.recv_into(buf)
        return bytes(buf[:n])

    def shutdown(self, how: int) -> None:
        if how in (socket.SHUT_RD, socket.SHUT_RDWR):
            self.feed_eof()
        if how in (socket.SHUT_WR, socket.SHUT_RDWR) and self.peer is not None:
            self.peer.feed_eof()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        if self.peer is not None:
            self.peer.feed_eof()
