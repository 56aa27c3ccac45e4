"""The StorageUnit: one arena, its allocator, its key table, and the remote-call surface.

A unit stores write-once blobs (keys) in a pinned host arena and serves them
to transports as an :class:`~gputq.transport.handler.ArenaHandler`.
It is plain Python and thread-safe: the tcp and NIXL servers call it from
many threads, and a Ray actor wraps it elsewhere. The key table and its
ownership rules live in :mod:`gputq.unit.keytable`; leases, reservations and the
timer that expires them in :mod:`gputq.unit.leases`; the line of writers
waiting for space in :mod:`gputq.unit.admission`.

Partitions are normalised to ``str`` (msgpack maps need string keys); a
write whose ``meta`` has no ``partition`` belongs to :data:`DEFAULT_PARTITION`.
"""

from __future__ import annotations

import inspect
import logging
import secrets
import threading
import time
from collections import Counter
from typing import Any, Sequence

import numpy as np

from gputq.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    InvalidInputError,
    RequestTooLargeError,
    StaleReadError,
    UnknownKeyError,
)
from gputq.transport.base import Closeable
from gputq.transport.directory import KeyDirectory, directory_nbytes, directory_slots
from gputq.transport.handler import ArenaHandler, Lease, Region
from gputq.transport.spans import span_regions
from gputq.unit.admission import WriteQueue
from gputq.unit.allocator import FreeListAllocator
from gputq.unit.arena import Arena
from gputq.unit.keytable import (
    COMMITTED,
    DEFAULT_PARTITION,
    RESERVED,
    Entry,
    KeyTable,
    check_generations,
    check_key,
    check_keys,
    check_meta,
    check_nbytes,
    check_page,
    check_partition,
    check_release_id,
)
from gputq.unit.leases import ExpiryTimer, LeaseBook

__all__ = ["StorageUnit", "DEFAULT_PARTITION", "CONTROL_METHODS"]

log = logging.getLogger(__name__)

#: Methods reachable through :meth:`StorageUnit.control` (the remote API).
CONTROL_METHODS = frozenset({
    "release", "release_partition", "add_ref", "transfer", "delete", "lookup", "stats", "keys",
})


class StorageUnit(ArenaHandler, Closeable):
    """A pinned host arena plus a key table with reference-counted ownership.

    Safety. A full unit makes writers wait up to their timeout, then raises
    :class:`CapacityError`; nothing is dropped or overwritten. Reads are
    leased: a key freed while leased leaves the table at once (new reads get
    :class:`UnknownKeyError`), but its region goes back to the allocator only
    when the last lease on it ends, so a read racing a release gets that
    key's bytes and never another key's. References name the unit's
    :attr:`incarnation` and each key's generation; a lease that names
    another incarnation or generation raises :class:`StaleReadError`.

    Write admission. Waiting writers queue in arrival order; a smaller
    write that fits may pass them until the first in line has waited
    ``write_aging_s`` (:mod:`gputq.unit.admission`). So no write waits
    forever behind smaller ones; a write still gives up with
    :class:`CapacityError` at its own timeout.

    Expiry. Expiring leases end after ``lease_timeout_s`` and reservations
    (writes begun, not yet committed) are aborted after
    ``reservation_timeout_s``, both on the unit's own timer thread, so space
    comes back with no other activity on the unit. A commit after the
    reservation deadline is refused even before the timer ran. A transport
    must finish receiving a write into its region before the reservation
    deadline (they bound it by :func:`gputq.transport.handler.write_window`).

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
        Lifetime of an expiring lease: its reader died or gave up (readers
        time out well before; keep it above the read timeout).
    reservation_timeout_s : float, optional
        Lifetime of a reservation: a write not committed by then is aborted
        and its space freed. Transports give a write's bytes half of it to
        arrive: keep it above twice the writers' transfer time.
    write_aging_s : float, optional
        How long the first waiting writer may be passed by smaller writes.

    Attributes
    ----------
    name : str
    incarnation : str
        16 random hex characters, new for each StorageUnit object.
    lease_timeout_s, reservation_timeout_s : float
        As given.
    """

    def __init__(self, name: str, capacity_bytes: int, *, put_timeout_s: float = 30.0,
                 shm_dir: str | None = None, alignment: int = 256, lease_timeout_s: float = 600.0,
                 reservation_timeout_s: float = 60.0, write_aging_s: float = 1.0):
        for what, value in (("put_timeout_s", put_timeout_s), ("write_aging_s", write_aging_s)):
            if value < 0:
                raise InvalidInputError(f"{what} must be >= 0, got {value}")
        for what, value in (("lease_timeout_s", lease_timeout_s),
                            ("reservation_timeout_s", reservation_timeout_s)):
            if value <= 0:
                raise InvalidInputError(f"{what} must be > 0, got {value}")
        self._name = name
        self._incarnation = secrets.token_hex(8)
        self.put_timeout_s = float(put_timeout_s)
        self._lease_timeout_s = float(lease_timeout_s)
        self._reservation_timeout_s = float(reservation_timeout_s)
        self._alloc = FreeListAllocator(capacity_bytes, alignment)  # validates before allocating
        self._arena = Arena(capacity_bytes, name, shm_dir)
        # Where committed keys lie, for same-host readers to start copying before their lease
        # is granted (gputq.transport.directory); a file of its own, so readers map it read-only.
        slots = directory_slots(capacity_bytes)
        try:
            self._directory_file = Arena(directory_nbytes(slots), f"{name}-keys", shm_dir, pin=False)
        except BaseException:
            self._arena.close()
            raise
        self._directory = KeyDirectory(self._directory_file.array, slots)
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # writers waiting for space
        self._table = KeyTable(name, self._on_forget)
        self._book = LeaseBook(self.lease_timeout_s, self.reservation_timeout_s, self._free_region)
        self._counters = Counter()
        self._admission = WriteQueue(self._space, write_aging_s, self._counters)
        self._closed = False
        self._timer = ExpiryTimer(threading.Condition(self._lock), self._expire_due,
                                  f"gputq-unit-timer-{name}")

    # -- ArenaHandler -----------------------------------------------------------

    @property
    def name(self) -> str:
        """The unit's name."""
        return self._name

    @property
    def incarnation(self) -> str:
        """16 random hex characters, new for each StorageUnit object."""
        return self._incarnation

    @property
    def write_aging_s(self) -> float:
        """How long the first waiting writer may be passed by smaller writes, in seconds."""
        return self._admission.aging_s

    @property
    def lease_timeout_s(self) -> float:
        """Lifetime of an expiring lease, in seconds."""
        return self._lease_timeout_s

    @property
    def reservation_timeout_s(self) -> float:
        """Lifetime of a write's reservation, in seconds."""
        return self._reservation_timeout_s

    @property
    def arena(self) -> memoryview:
        """The whole arena as one writable byte view."""
        return self._arena.view

    @property
    def arena_path(self) -> str:
        """Shared-memory file of the arena, for same-host mapping."""
        return self._arena.path

    @property
    def directory_file(self) -> dict:
        """The key directory's shared-memory file: ``{"path", "slots"}`` (see :mod:`gputq.transport.directory`)."""
        return {"path": self._directory_file.path, "slots": self._directory.slots}

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

        A writer that finds the arena full waits up to ``timeout`` seconds
        (``None``: ``put_timeout_s``) for releases to make room, under the
        admission policy of the class docstring. ``meta["generation"]``
        (an int in ``[1, 2**63)``) is the key's generation, chosen by the
        writer; without it the unit draws one.

        Raises
        ------
        DuplicateKeyError
            ``key`` is already stored or being written.
        RequestTooLargeError
            ``nbytes`` exceeds the arena.
        CapacityError
            No space within the timeout; names key, size and free bytes.
        InvalidInputError
            A malformed key, size, meta, generation, partition or timeout.
        """
        key, nbytes, meta, partition, generation, timeout = self._write_args(key, nbytes, meta, timeout)
        now = time.monotonic()
        deadline = now + min(max(0.0, float(timeout)), threading.TIMEOUT_MAX)  # NaN: 0, inf: TIMEOUT_MAX
        with self._lock:
            offset = self._admission.allocate(lambda: self._alloc.allocate(nbytes),
                                              lambda: self._may_write(key), now, deadline)
            if offset is None:
                self._counters["capacity_errors"] += 1
                raise CapacityError(
                    f"unit {self.name}: no space for key {key!r} ({nbytes} bytes) "
                    f"within {timeout:g} s; free {self._alloc.free_bytes} bytes, "
                    f"largest free block {self._alloc.largest_free} bytes, "
                    f"{len(self._admission)} other writers waiting")
            entry = Entry(key, offset, nbytes, meta, generation)
            self._table.reserve(entry, partition)
            self._timer.poke(self._book.reserve(entry, time.monotonic()))  # under the lock: in order
        return offset

    def _write_args(self, key, nbytes, meta, timeout) -> tuple:
        """:meth:`begin_write`'s arguments checked: key, size, meta, partition, generation and timeout."""
        key = check_key(self.name, key)
        nbytes = check_nbytes(self.name, nbytes)
        meta, partition, generation = check_meta(self.name, meta)
        if timeout is None:
            timeout = self.put_timeout_s
        elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise InvalidInputError(f"unit {self.name}: timeout must be a number or None, got {timeout!r}")
        if not self._alloc.fits_ever(nbytes):
            raise RequestTooLargeError(
                f"unit {self.name}: key {key!r} needs {nbytes} bytes, arena holds {self.capacity}")
        return key, nbytes, meta, partition, generation, timeout

    def commit_write(self, key: str, generation: int | None = None) -> dict:
        """Make a reserved, fully written key readable; return ``{"offset", "nbytes",
        "generation", "incarnation"}``.

        ``generation``, the one the write's meta carried, names the
        reservation: a writer whose reservation expired, and whose key was
        reserved again by another write meanwhile, cannot commit that one.

        Raises
        ------
        UnknownKeyError
            ``key`` is not reserved (never begun, aborted, or its reservation
            expired), the reservation is another write's (``generation``
            differs), or its partition was released while it was being
            written (the reservation is then freed).
        """
        key = check_key(self.name, key)
        with self._lock:
            entry = self._reserved(key, generation)
            if entry is not None and entry.state == RESERVED \
                    and self._book.reservation_expired(entry, time.monotonic()):
                # Expired but not reaped yet: refused all the same, so whether a late
                # commit counts never depends on how soon the timer ran.
                self._book.unreserve(entry)
                self._table.forget(entry)
                self._counters["reservations_expired"] += 1
                entry = None
            if entry is None or entry.state != RESERVED:
                raise UnknownKeyError(
                    f"unit {self.name}: no write in progress for key {key!r} (never begun, aborted, "
                    f"or its reservation expired after {self.reservation_timeout_s:g} s)")
            self._book.unreserve(entry)
            if not entry.holders:
                self._table.forget(entry)
                raise UnknownKeyError(f"unit {self.name}: key {key!r} was released while being written")
            entry.state = COMMITTED
            self._directory.publish(key, entry.generation, entry.offset, entry.nbytes)
            self._counters["puts"] += 1
            self._counters["bytes_written"] += entry.nbytes
            return {"offset": entry.offset, "nbytes": entry.nbytes, "generation": entry.generation,
                    "incarnation": self.incarnation}

    def abort_write(self, key: str, generation: int | None = None) -> None:
        """Drop the reservation of ``key`` (of the write whose meta carried ``generation``,
        when given). Unknown keys, and another write's reservation of the key, are ignored."""
        key = check_key(self.name, key)
        with self._lock:
            entry = self._reserved(key, generation)
            if entry is None:
                return
            if entry.state != RESERVED:
                raise InvalidInputError(
                    f"unit {self.name}: key {key!r} is committed; use delete() to remove it")
            self._table.forget(entry)

    def _reserved(self, key: str, generation: int | None):
        """``key``'s entry, unless ``generation`` is given and names another write."""
        if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)):
            raise InvalidInputError(f"unit {self.name}: generation must be an int, got {generation!r}")
        entry = self._table.get(key)
        if entry is not None and generation is not None and entry.generation != generation:
            return None
        return entry

    def lease(self, keys: Sequence[str], generations: Sequence[int] | None = None,
              incarnation: str | None = None, *, expires: bool = True) -> Lease:
        """Pin the regions of ``keys`` (in order) until :meth:`end_lease`.

        Parameters
        ----------
        keys : list of str
        generations : list of int, optional
            One per key: the generation the caller's reference names; ``0``
            or ``None`` entries are not checked.
        incarnation : str, optional
            The unit incarnation the caller's references name.
        expires : bool, optional
            False for a lease the caller always ends itself (a server's own
            send); True leases end after ``lease_timeout_s`` regardless.

        Raises
        ------
        StaleReadError
            ``incarnation`` is not this unit's (it restarted), or a key's
            stored generation differs from the one expected (the key was
            deleted and written again).
        UnknownKeyError
            Names the first key that is unknown or not yet committed.
        """
        lease_id, entries, _ = self._pin(keys, generations, incarnation, expires)
        return Lease(lease_id, tuple(Region(e.offset, e.nbytes) for e in entries),
                     tuple(e.generation for e in entries))

    def lease_regions(self, keys: Sequence[str], generations: Sequence[int] | None = None,
                      incarnation: str | None = None, *, expires: bool = True,
                      spans: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """:meth:`lease` as ``(lease_id, int64 [n, 2] of (offset, nbytes))``.

        The servers' fast path: a 1024-key lease without building 1024
        ``Region`` objects. With ``spans`` (checked int64 ``[m, 3]`` of (key
        index, offset, nbytes)) the rows are the spans' regions, and only
        their bytes count as read (``bytes_read``); a span outside its key's
        blob raises ``InvalidInputError`` and nothing is leased.
        """
        lease_id, _, regions = self._pin(keys, generations, incarnation, expires, spans)
        return lease_id, regions

    def _pin(self, keys: Sequence[str], generations=None, incarnation=None,
             expires: bool = True, spans: np.ndarray | None = None) -> tuple[int, list[Entry], np.ndarray]:
        if not isinstance(keys, (list, tuple)):
            raise InvalidInputError(f"unit {self.name}: keys must be a list of str, got {type(keys).__name__}")
        if incarnation is not None:
            if not isinstance(incarnation, str):
                raise InvalidInputError(f"unit {self.name}: incarnation must be a str, got {incarnation!r}")
            if incarnation != self.incarnation:
                raise StaleReadError(
                    f"unit {self.name} restarted: reference is for incarnation {incarnation}, "
                    f"unit is incarnation {self.incarnation}")
        if not isinstance(expires, bool):
            raise InvalidInputError(f"unit {self.name}: expires must be a bool, got {expires!r}")
        with self._lock:
            self._check_open()
            try:
                entries = self._table.committed_many(keys)
            except (UnknownKeyError, TypeError):
                check_keys(self.name, keys)  # a malformed key is bad input, not a missing key
                raise
            if generations is not None:
                check_generations(self.name, entries, generations)
            regions = np.empty((len(entries), 2), dtype=np.int64)
            regions[:, 0] = np.fromiter((e.offset for e in entries), np.int64, len(entries))
            regions[:, 1] = np.fromiter((e.nbytes for e in entries), np.int64, len(entries))
            regions = span_regions(regions, spans, keys, self.name)  # before pinning: a bad span leases nothing
            lease_id, deadline = self._book.pin(entries, expires, time.monotonic())
            if deadline is not None:
                self._timer.poke(deadline)
            self._counters["reads"] += 1
            self._counters["bytes_read"] += int(regions[:, 1].sum())
        return lease_id, entries, regions

    def end_lease(self, lease_id: int) -> bool:
        """Unpin a lease; regions released meanwhile are freed now. Idempotent.

        Returns True when the lease was still held; False when it had expired
        (its regions may hold another key's bytes by now) or is unknown.
        """
        if isinstance(lease_id, bool) or not isinstance(lease_id, (int, np.integer)):
            raise InvalidInputError(f"unit {self.name}: lease_id must be an int, got {lease_id!r}")
        with self._lock:
            return self._book.end(int(lease_id))

    def control(self, method: str, args: dict | None = None) -> Any:
        """Run one of :data:`CONTROL_METHODS` with keyword ``args``.

        Any malformed call (unknown method, arguments missing, unexpected or
        of the wrong type) raises :class:`InvalidInputError`.
        """
        if not isinstance(method, str) or method not in CONTROL_METHODS:
            raise InvalidInputError(f"unit {self.name}: unknown control method {method!r}")
        args = {} if args is None else args
        if not isinstance(args, dict) or not all(isinstance(name, str) for name in args):
            raise InvalidInputError(f"unit {self.name}: {method} takes a dict of named arguments, got {args!r}")
        function = getattr(self, method)
        try:
            inspect.signature(function).bind(**args)
        except TypeError as exc:
            raise InvalidInputError(f"unit {self.name}: bad arguments for {method}: {exc}") from None
        return function(**args)

    # -- ownership -----------------------------------------------------------------

    def release(self, keys: Sequence[str], partition: str | None = None, *,
                missing_ok: bool = False, release_id: str | None = None) -> int:
        """Drop one reference of ``partition`` per listed key (all references if None).

        Validates every key before changing anything.

        Parameters
        ----------
        release_id : str, optional
            Makes the call exactly-once: a ``release_id`` already applied on
            this unit (for this partition) makes it a no-op returning 0.

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
        keys = check_keys(self.name, keys)
        partition = None if partition is None else check_partition(self.name, partition)
        if not isinstance(missing_ok, bool):
            raise InvalidInputError(f"unit {self.name}: missing_ok must be a bool, got {missing_ok!r}")
        release_id = check_release_id(self.name, release_id)
        with self._lock:
            self._check_open()
            return self._table.release(keys, partition, missing_ok, release_id)

    def release_partition(self, partition: str) -> int:
        """Drop every reference ``partition`` holds; return the number of keys freed.

        Keys still being written lose the reference too: their commit then
        fails, and their space is freed then or when the reservation expires.
        Release ids remembered for ``partition`` are forgotten.
        """
        partition = check_partition(self.name, partition)
        with self._lock:
            self._check_open()
            return self._table.release_partition(partition)

    def add_ref(self, keys: Sequence[str], partition: str) -> None:
        """Give ``partition`` one more reference to each key (a shared step)."""
        keys, partition = check_keys(self.name, keys), check_partition(self.name, partition)
        with self._lock:
            self._check_open()
            self._table.add_ref(keys, partition)

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
        keys = check_keys(self.name, keys)
        src, dst = check_partition(self.name, from_partition), check_partition(self.name, to_partition)
        with self._lock:
            self._check_open()
            return self._table.transfer(keys, src, dst)

    def delete(self, keys: Sequence[str]) -> int:
        """Remove committed keys whatever their references (commit-region rollback).

        Unknown keys are ignored. Returns the number of keys removed.
        """
        keys = check_keys(self.name, keys)
        with self._lock:
            self._check_open()
            return self._table.delete(keys)

    # -- queries -----------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> list[dict]:
        """Metadata of committed keys: offset, nbytes, generation, meta, holders."""
        keys = check_keys(self.name, keys)
        with self._lock:
            return self._table.lookup(keys)

    def keys(self, after: str | None = None, limit: int | None = None) -> dict:
        """Stored keys and their references, for invariant checks.

        ``{"unit", "incarnation", "partitions": {partition: {key: references}},
        "reserved": [keys being written], "next": str or None}``. A large unit
        is listed in pages: ``limit`` keys in name order after ``after``, the
        next page after ``"next"``.
        """
        check_page(self.name, after, limit)
        with self._lock:
            return {"unit": self.name, "incarnation": self.incarnation, **self._table.snapshot(after, limit)}

    def stats(self) -> dict:
        """Occupancy, partitions, leases, reservations and counters (msgpack-able)."""
        with self._lock:
            committed, reserved = self._table.counts()
            now = time.monotonic()
            return {
                "name": self.name,
                "incarnation": self.incarnation,
                "capacity": self._alloc.capacity,
                "used": self._alloc.used_bytes,
                "free": self._alloc.free_bytes,
                "largest_free": self._alloc.largest_free,
                "free_blocks": self._alloc.num_free_blocks,
                "keys": committed,
                "reserved": reserved,
                "reservations": self._book.reservations,
                "partitions": self._table.partition_stats(),
                "leases": self._book.leases,
                "pending_free_bytes": self._book.pending_free_bytes,
                "writers_waiting": len(self._admission),
                "first_writer_wait_s": self._admission.first_wait_s(now),
                "pinned": self._arena.pinned,
                "arena_path": self._arena.path,
                "closed": self._closed,
                **{k: self._counters[k] for k in
                   ("puts", "reads", "bytes_written", "bytes_read", "waits", "wait_us",
                    "capacity_errors", "leases_expired", "reservations_expired")},
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
        lease = self.lease(keys, expires=False)
        try:
            array = self._arena.array
            return [array[r.offset:r.offset + r.nbytes].copy() for r in lease.regions]
        finally:
            self.end_lease(lease.lease_id)

    def close(self) -> None:
        """Wake waiting writers (they get ``ClosedError``), stop the timer, free the arena. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._space.notify_all()
        self._timer.stop()
        self._arena.close()
        self._directory.close()  # its view of the file would keep the mapping, and its descriptor, open
        self._directory_file.close()

    def __repr__(self) -> str:
        return (f"StorageUnit(name={self.name!r}, incarnation={self.incarnation!r}, "
                f"capacity={self._alloc.capacity}, used={self._alloc.used_bytes}, keys={len(self._table)})")

    # -- internals (call with the lock held) ------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"unit {self.name} is closed")

    def _may_write(self, key: str) -> None:
        """Raise for a writer of ``key`` that must stop waiting: the unit closed, or the key stored meanwhile."""
        self._check_open()
        if key in self._table:
            raise DuplicateKeyError(f"unit {self.name}: key {key!r} already exists")

    def _expire_due(self) -> float | None:
        """The timer's work: end expired leases, abort expired reservations."""
        if self._closed:
            return None
        now = time.monotonic()
        leases = list(self._book.due_leases(now))
        for lease_id in leases:
            self._book.end(lease_id)
        writes = self._book.due_reservations(now)
        for entry in writes:
            self._table.forget(entry)
        # One line per pass: a dead reader may leave thousands of leases behind.
        if leases:
            self._counters["leases_expired"] += len(leases)
            log.warning("unit %s: %d lease(s) expired after %g s, their readers gone (ids %s)",
                        self.name, len(leases), self.lease_timeout_s, leases[:5])
        if writes:
            self._counters["reservations_expired"] += len(writes)
            log.warning("unit %s: %d write(s) not committed within %g s, aborted (keys %s)",
                        self.name, len(writes), self.reservation_timeout_s, [e.key for e in writes[:5]])
        return self._book.next_deadline()

    def _on_forget(self, entry: Entry) -> None:
        self._directory.withdraw(entry.key, entry.generation)
        self._book.unreserve(entry)
        self._book.park_or_free(entry)

    def _free_region(self, entry: Entry) -> None:
        self._alloc.free(entry.offset)
        self._space.notify_all()
