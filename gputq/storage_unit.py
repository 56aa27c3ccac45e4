"""The StorageUnit: one arena, its allocator, and a reference-counted key table.

A unit stores write-once blobs (keys) in a pinned host arena and serves them
to transports through the :class:`~transport.base.ArenaHandler` protocol.
It is plain Python and thread-safe: the tcp and NIXL servers call it from
many threads, and a Ray actor wraps it elsewhere.

Ownership (DESIGN.md §3b). Every key carries a counter of references per
*partition* (rollout). The writing partition holds the first reference;
``add_ref`` shares a key into another partition, ``transfer`` moves a
partition's references to another without moving bytes, ``release`` and
``release_partition`` drop references, and ``delete`` removes keys outright
(commit-region rollback). A key is freed when its last reference goes.

Safety (§3 rules 6-7). A full unit makes writers wait (FIFO) up to their
timeout, then raises :class:`CapacityError`; nothing is dropped or
overwritten. Reads are leased: a key freed while leased leaves the table at
once (new reads get :class:`UnknownKeyError`) but its region is returned to
the allocator only when the last lease on it ends, so a read racing a
release still gets that key's bytes and never another key's.

Partitions are normalised to ``str`` (msgpack maps need string keys); a
write whose ``meta`` has no ``partition`` belongs to :data:`DEFAULT_PARTITION`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gputq.allocator import FreeListAllocator
from gputq.arena import Arena
from transport.base import Closeable, Lease, Region
from transport.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    InvalidInputError,
    RequestTooLargeError,
    UnknownKeyError,
)

__all__ = ["StorageUnit", "DEFAULT_PARTITION", "CONTROL_METHODS"]

log = logging.getLogger(__name__)

DEFAULT_PARTITION = "default"

#: Methods reachable through :meth:`StorageUnit.control` (the remote API).
CONTROL_METHODS = frozenset({
    "release", "release_partition", "add_ref", "transfer", "delete", "lookup", "stats",
})

_RESERVED = "reserved"
_COMMITTED = "committed"


@dataclass(eq=False)
class _Entry:
    key: str
    offset: int
    nbytes: int
    meta: dict
    generation: int
    state: str = _RESERVED
    holders: Counter = field(default_factory=Counter)
    leases: int = 0
    released: bool = False


class StorageUnit(Closeable):
    """A pinned host arena plus a key table with reference-counted ownership.

    Parameters
    ----------
    name : str
        Unit name (appears in errors, stats and the arena file name).
    capacity_bytes : int
        Arena size; allocated once, at construction.
    put_timeout_s : float, optional
        How long a write waits for space when its own timeout is ``None``.
    shm_dir : str, optional
        Where the arena's shared-memory file lives (default ``/dev/shm``).
    alignment : int, optional
        Alignment of every stored blob in the arena.
    lease_timeout_s : float, optional
        A lease older than this is ended by the unit: its reader died or
        gave up (readers time out well before; keep it above the read
        timeout), and a released region must not stay pinned forever.
    """

    def __init__(self, name: str, capacity_bytes: int, *, put_timeout_s: float = 30.0,
                 shm_dir: str | None = None, alignment: int = 256, lease_timeout_s: float = 600.0):
        if put_timeout_s < 0:
            raise InvalidInputError(f"put_timeout_s must be >= 0, got {put_timeout_s}")
        self.name = name
        self.put_timeout_s = float(put_timeout_s)
        self._alloc = FreeListAllocator(capacity_bytes, alignment)  # validates before allocating
        self._arena = Arena(capacity_bytes, name, shm_dir)
        self._cond = threading.Condition(threading.Lock())
        self._table: dict[str, _Entry] = {}
        self._partitions: dict[str, set[str]] = {}
        self._leases: dict[int, list[_Entry]] = {}
        self._lease_deadlines: dict[int, float] = {}  # insertion order is expiry order
        self.lease_timeout_s = float(lease_timeout_s)
        self._lease_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._write_queue: deque[object] = deque()
        self._pending_free_bytes = 0
        self._counters = Counter()
        self._closed = False

    # -- ArenaHandler -----------------------------------------------------------

    @property
    def arena(self) -> memoryview:
        """The whole arena as one writable byte view."""
        return self._arena.view

    @property
    def arena_path(self) -> str:
        """Shared-memory file of the arena, for same-host mapping."""
        return self._arena.path

    @property
    def pinned(self) -> bool:
        """True when the arena is page-locked with CUDA."""
        return self._arena.pinned

    @property
    def capacity(self) -> int:
        """Bytes the allocator can hand out."""
        return self._alloc.capacity

    def begin_write(self, key: str, nbytes: int, meta: dict | None,
                    timeout: float | None = None) -> int:
        """Reserve ``nbytes`` for ``key`` and return its arena offset.

        Writers are served in arrival order; one that finds the arena full
        waits up to ``timeout`` seconds (``None``: ``put_timeout_s``) for
        releases to make room.

        Raises
        ------
        DuplicateKeyError
            ``key`` is already stored or being written.
        RequestTooLargeError
            ``nbytes`` exceeds the arena.
        CapacityError
            No space within the timeout; names key, size and free bytes.
        """
        if not isinstance(key, str) or not key:
            raise InvalidInputError(f"unit {self.name}: key must be a non-empty str, got {key!r}")
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise InvalidInputError(f"unit {self.name}: nbytes must be an int >= 0, got {nbytes!r}")
        nbytes = int(nbytes)
        meta = dict(meta or {})
        partition = str(meta.get("partition", DEFAULT_PARTITION))
        if not self._alloc.fits_ever(nbytes):
            raise RequestTooLargeError(
                f"unit {self.name}: key {key!r} needs {nbytes} bytes, arena holds {self.capacity}")
        timeout = self.put_timeout_s if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + timeout
        ticket = object()
        waited_since = None
        with self._cond:
            self._write_queue.append(ticket)
            try:
                while True:
                    self._check_open()
                    if key in self._table:
                        raise DuplicateKeyError(f"unit {self.name}: key {key!r} already exists")
                    if self._write_queue[0] is ticket:
                        self._expire_leases()
                        offset = self._alloc.allocate(nbytes)
                        if offset is not None:
                            break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._counters["capacity_errors"] += 1
                        raise CapacityError(
                            f"unit {self.name}: no space for key {key!r} ({nbytes} bytes) "
                            f"within {timeout:g} s; free {self._alloc.free_bytes} bytes, "
                            f"largest free block {self._alloc.largest_free} bytes, "
                            f"{len(self._write_queue) - 1} other writers waiting")
                    if waited_since is None:
                        waited_since = time.monotonic()
                        self._counters["waits"] += 1
                    if self._lease_deadlines:  # wake when the oldest lease expires, too
                        remaining = min(remaining, max(0.001, next(iter(self._lease_deadlines.values()))
                                                       - time.monotonic()))
                    self._cond.wait(remaining)
            finally:
                self._write_queue.remove(ticket)
                if waited_since is not None:
                    self._counters["wait_us"] += int((time.monotonic() - waited_since) * 1e6)
                self._cond.notify_all()  # the next writer in line may fit now
            entry = _Entry(key, offset, nbytes, meta, next(self._generations))
            self._table[key] = entry
            self._add_holder(entry, partition, 1)
        return offset

    def commit_write(self, key: str) -> dict:
        """Make a reserved, fully written key readable; return its receipt.

        Raises
        ------
        UnknownKeyError
            ``key`` is not reserved, or its partition was released while it
            was being written (the reservation is then freed).
        """
        with self._cond:
            entry = self._table.get(key)
            if entry is None or entry.state != _RESERVED:
                raise UnknownKeyError(f"unit {self.name}: no write in progress for key {key!r}")
            if not entry.holders:
                self._forget(entry)
                raise UnknownKeyError(
                    f"unit {self.name}: key {key!r} was released while being written")
            entry.state = _COMMITTED
            self._counters["puts"] += 1
            self._counters["bytes_written"] += entry.nbytes
            return {"offset": entry.offset, "generation": entry.generation,
                    "nbytes": entry.nbytes}

    def abort_write(self, key: str) -> None:
        """Drop the reservation of ``key``. Unknown keys are ignored."""
        with self._cond:
            entry = self._table.get(key)
            if entry is None:
                return
            if entry.state != _RESERVED:
                raise InvalidInputError(
                    f"unit {self.name}: key {key!r} is committed; use delete() to remove it")
            self._forget(entry)

    def lease(self, keys: Sequence[str]) -> Lease:
        """Pin the regions of ``keys`` (in order) until :meth:`end_lease`.

        Raises
        ------
        UnknownKeyError
            Names the first key that is unknown or not yet committed.
        """
        lease_id, entries = self._pin(keys)
        return Lease(lease_id, tuple(Region(e.offset, e.nbytes) for e in entries),
                     tuple(e.generation for e in entries))

    def lease_regions(self, keys: Sequence[str]) -> tuple[int, np.ndarray]:
        """:meth:`lease` as ``(lease_id, int64 [n, 2] of (offset, nbytes))``.

        The NIXL server's fast path: a 1024-key lease without building
        1024 ``Region`` objects.
        """
        lease_id, entries = self._pin(keys)
        regions = np.empty((len(entries), 2), dtype=np.int64)
        regions[:, 0] = np.fromiter((e.offset for e in entries), np.int64, len(entries))
        regions[:, 1] = np.fromiter((e.nbytes for e in entries), np.int64, len(entries))
        return lease_id, regions

    def _pin(self, keys: Sequence[str]) -> tuple[int, list]:
        with self._cond:
            self._check_open()
            self._expire_leases()
            entries = [self._committed(k) for k in keys]
            for entry in entries:
                entry.leases += 1
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = entries
            self._lease_deadlines[lease_id] = time.monotonic() + self.lease_timeout_s
            self._counters["reads"] += 1
            self._counters["bytes_read"] += sum(e.nbytes for e in entries)
        return lease_id, entries

    def end_lease(self, lease_id: int) -> None:
        """Unpin a lease; regions released meanwhile are freed now. Idempotent."""
        with self._cond:
            self._end_lease(lease_id)

    def _end_lease(self, lease_id: int) -> None:
        self._lease_deadlines.pop(lease_id, None)
        for entry in self._leases.pop(lease_id, ()):
            entry.leases -= 1
            if entry.leases == 0 and entry.released:
                self._pending_free_bytes -= entry.nbytes
                self._free_region(entry)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        while self._lease_deadlines:
            lease_id, deadline = next(iter(self._lease_deadlines.items()))
            if deadline > now:
                return
            log.warning("unit %s: lease %d expired after %.0f s; its reader is gone",
                        self.name, lease_id, self.lease_timeout_s)
            self._counters["leases_expired"] += 1
            self._end_lease(lease_id)

    def control(self, method: str, args: dict | None = None) -> Any:
        """Run one of :data:`CONTROL_METHODS` with keyword ``args``."""
        if method not in CONTROL_METHODS:
            raise InvalidInputError(f"unit {self.name}: unknown control method {method!r}")
        try:
            return getattr(self, method)(**(args or {}))
        except TypeError as exc:
            raise InvalidInputError(f"unit {self.name}: bad arguments for {method}: {exc}") from exc

    # -- lifecycle ---------------------------------------------------------------

    def release(self, keys: Sequence[str], partition: str | None = None, *,
                missing_ok: bool = False) -> int:
        """Drop one reference of ``partition`` per listed key (all references if None).

        Validates every key before changing anything.

        Returns
        -------
        int
            Number of keys freed (their last reference went).

        Raises
        ------
        UnknownKeyError
            A key is not stored (unless ``missing_ok``).
        InvalidInputError
            ``partition`` holds fewer references to a key than requested
            (unless ``missing_ok``: then the references it does not hold,
            e.g. of keys transferred away, are skipped).
        """
        with self._cond:
            self._check_open()
            wanted = Counter(k for k in keys if self._visible(k) or not missing_ok)
            if missing_ok and partition is not None:
                wanted = Counter({key: min(count, self._table[key].holders[str(partition)])
                                  for key, count in wanted.items()})
                wanted = +wanted  # drop keys the partition holds no reference to
            for key, count in wanted.items():
                entry = self._committed(key)
                if partition is not None and entry.holders[str(partition)] < count:
                    raise InvalidInputError(
                        f"unit {self.name}: partition {partition!r} holds "
                        f"{entry.holders[str(partition)]} reference(s) to key {key!r}, "
                        f"cannot release {count}")
            freed = 0
            for key, count in wanted.items():
                entry = self._table[key]
                if partition is None:
                    for holder in list(entry.holders):
                        self._drop_holder(entry, holder, entry.holders[holder])
                else:
                    self._drop_holder(entry, str(partition), count)
                freed += self._free_if_unheld(entry)
            return freed

    def release_partition(self, partition: str) -> int:
        """Drop every reference ``partition`` holds; return the number of keys freed.

        Keys still being written lose the reference too: their commit then
        fails and the reservation is freed.
        """
        partition = str(partition)
        with self._cond:
            self._check_open()
            freed = 0
            for key in list(self._partitions.get(partition, ())):
                entry = self._table[key]
                self._drop_holder(entry, partition, entry.holders[partition])
                if entry.state == _COMMITTED:
                    freed += self._free_if_unheld(entry)
            return freed

    def add_ref(self, keys: Sequence[str], partition: str) -> None:
        """Give ``partition`` one more reference to each key (a shared step)."""
        with self._cond:
            self._check_open()
            entries = [self._committed(k) for k in keys]
            for entry in entries:
                self._add_holder(entry, str(partition), 1)

    def transfer(self, keys: Sequence[str], from_partition: str, to_partition: str) -> int:
        """Move ``from_partition``'s references of ``keys`` to ``to_partition``.

        No bytes move; releasing ``from_partition`` afterwards leaves the keys
        alive. Returns the number of keys moved.

        Raises
        ------
        UnknownKeyError
            A key is not stored.
        InvalidInputError
            ``from_partition`` holds no reference to a key.
        """
        src, dst = str(from_partition), str(to_partition)
        with self._cond:
            self._check_open()
            entries = list({k: self._committed(k) for k in keys}.values())
            for entry in entries:
                if entry.holders.get(src, 0) == 0:
                    raise InvalidInputError(
                        f"unit {self.name}: partition {src!r} holds no reference to key {entry.key!r}")
            if src != dst:
                for entry in entries:
                    count = entry.holders[src]
                    self._drop_holder(entry, src, count)
                    self._add_holder(entry, dst, count)
            return len(entries)

    def delete(self, keys: Sequence[str]) -> int:
        """Remove committed keys whatever their references (commit-region rollback).

        Unknown keys are ignored. Returns the number of keys removed.
        """
        with self._cond:
            self._check_open()
            removed = 0
            for key in keys:
                if self._visible(key):
                    self._forget(self._table[key])
                    removed += 1
            return removed

    # -- queries -----------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> list[dict]:
        """Metadata of committed keys: offset, nbytes, generation, meta, holders."""
        with self._cond:
            return [{"key": e.key, "offset": e.offset, "nbytes": e.nbytes,
                     "generation": e.generation, "meta": dict(e.meta),
                     "holders": dict(e.holders)}
                    for e in (self._committed(k) for k in keys)]

    def stats(self) -> dict:
        """Occupancy, partitions, leases and counters (msgpack-able)."""
        with self._cond:
            partitions = {}
            for name, keys in self._partitions.items():
                partitions[name] = {"keys": len(keys),
                                    "bytes": sum(self._table[k].nbytes for k in keys)}
            committed = sum(1 for e in self._table.values() if e.state == _COMMITTED)
            return {
                "name": self.name,
                "capacity": self._alloc.capacity,
                "used": self._alloc.used_bytes,
                "free": self._alloc.free_bytes,
                "largest_free": self._alloc.largest_free,
                "free_blocks": self._alloc.num_free_blocks,
                "keys": committed,
                "reserved": len(self._table) - committed,
                "partitions": partitions,
                "leases": len(self._leases),
                "pending_free_bytes": self._pending_free_bytes,
                "writers_waiting": len(self._write_queue),
                "pinned": self._arena.pinned,
                "arena_path": self._arena.path,
                "closed": self._closed,
                **{k: self._counters[k] for k in
                   ("puts", "reads", "bytes_written", "bytes_read", "waits", "wait_us",
                    "capacity_errors", "leases_expired")},
            }

    # -- in-process convenience -------------------------------------------------------

    def put(self, key: str, data, meta: dict | None = None, timeout: float | None = None) -> dict:
        """Store a C-contiguous bytes-like object (e.g. a numpy array) under ``key``."""
        try:
            src = memoryview(data)
        except TypeError as exc:
            raise InvalidInputError(f"unit {self.name}: key {key!r}: data is not bytes-like") from exc
        if not src.c_contiguous:
            raise InvalidInputError(f"unit {self.name}: key {key!r}: data must be C-contiguous")
        if src.nbytes == 0:
            src = memoryview(b"")  # cast() refuses shapes with a zero
        elif src.ndim != 1 or src.format != "B":
            src = src.cast("B")
        offset = self.begin_write(key, src.nbytes, meta, timeout)
        try:
            self._arena.view[offset:offset + src.nbytes] = src
        except BaseException:
            self.abort_write(key)
            raise
        return self.commit_write(key)

    def read(self, keys: Sequence[str]) -> list[np.ndarray]:
        """Copies of the bytes of ``keys`` as 1-D ``uint8`` arrays."""
        lease = self.lease(keys)
        try:
            array = self._arena.array
            return [array[r.offset:r.offset + r.nbytes].copy() for r in lease.regions]
        finally:
            self.end_lease(lease.lease_id)

    def close(self) -> None:
        """Wake waiting writers (they get ``ClosedError``) and free the arena. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._arena.close()


    def __repr__(self) -> str:
        return (f"StorageUnit(name={self.name!r}, capacity={self._alloc.capacity}, "
                f"used={self._alloc.used_bytes}, keys={len(self._table)})")

    # -- internals (call with the lock held) ------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"unit {self.name} is closed")

    def _visible(self, key: str) -> bool:
        entry = self._table.get(key)
        return entry is not None and entry.state == _COMMITTED

    def _committed(self, key: str) -> _Entry:
        entry = self._table.get(key)
        if entry is None or entry.state != _COMMITTED:
            raise UnknownKeyError(f"unit {self.name}: unknown key {key!r}")
        return entry

    def _add_holder(self, entry: _Entry, partition: str, count: int) -> None:
        entry.holders[partition] += count
        self._partitions.setdefault(partition, set()).add(entry.key)

    def _drop_holder(self, entry: _Entry, partition: str, count: int) -> None:
        left = entry.holders[partition] - count
        if left > 0:
            entry.holders[partition] = left
            return
        del entry.holders[partition]
        keys = self._partitions.get(partition)
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self._partitions[partition]

    def _free_if_unheld(self, entry: _Entry) -> int:
        if entry.holders:
            return 0
        self._forget(entry)
        return 1

    def _forget(self, entry: _Entry) -> None:
        """Remove ``entry`` from the table now; free its region once no lease pins it."""
        del self._table[entry.key]
        for partition in list(entry.holders):
            self._drop_holder(entry, partition, entry.holders[partition])
        if entry.leases:
            entry.released = True
            self._pending_free_bytes += entry.nbytes
        else:
            self._free_region(entry)

    def _free_region(self, entry: _Entry) -> None:
        self._alloc.free(entry.offset)
        self._cond.notify_all()
