"""The writer's background sends: steps queued per unit, sent in batches, failures kept for flush.

A put hands its compacted fields here (:meth:`SendQueue.submit`) and
returns. Sender threads take a unit's queued steps and send every one
waiting in one request (:meth:`~gputq.transport.base.Channel.write_many`):
while a batch is on the wire the next puts queue behind it, so steps that
come faster than a request's round trip pay that round trip, and the unit's
work per request, once a batch instead of once a step. A batch holds at
most :data:`BATCH_STEPS` steps and :data:`BATCH_BYTES` bytes.

A step is stored whole or not at all: when one of its fields fails, those
of its fields that landed are deleted before any of its keys stops being
pending. Queued bytes are bounded (``writer_inflight_bytes``): that bound
is the only way the senders can hold a put up. Sent buffers are kept for
the next puts within the same bound: a fresh buffer of a large step costs
the kernel a page fault per 4 KiB. The senders run at a lower CPU priority
than the caller, so on a busy host their socket copies do not take the
core a put needs.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gputq.client.clients import UnitClients
from gputq.config import GputqConfig
from gputq.data.refs import FieldRef
from gputq.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    GputqError,
    GputqTimeoutError,
    TransferError,
    UnitLostError,
    add_note,
)
from gputq.transport.base import byte_view

__all__ = ["SendQueue", "Buffers", "SENDER_NICE", "BATCH_STEPS", "BATCH_BYTES"]

#: How much lower the sender threads' CPU priority is than the caller's (Linux nice steps).
SENDER_NICE = 10
#: The most steps one request carries, and the most bytes (a step larger than that goes alone). A
#: request's fixed cost is a small share of a few MiB already; a larger batch only makes the unit's
#: receive one longer burst on the cores the caller's puts need (their tail grows).
BATCH_STEPS = 64
BATCH_BYTES = 4 << 20


class SendQueue:
    """Queued steps of one writer and the threads that send them.

    Parameters
    ----------
    clients:
        Channels to the units (``channel(unit).write_many``, ``call``).
    config:
        Supplies ``writer_threads``, ``writer_inflight_bytes``,
        ``put_timeout_s`` and ``control_timeout_s``.
    """

    def __init__(self, clients: UnitClients, config: GputqConfig):
        self._clients = clients
        self._config = config
        self._pool = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="gputq-writer",
                                        initializer=_background_priority)
        self.buffers = Buffers(config.writer_inflight_bytes)
        self._cond = threading.Condition()
        self._inflight_bytes = 0
        self._queued: dict[str, collections.deque] = {}
        self._pending: set[str] = set()
        self._failures: dict[str, BaseException] = {}
        self._full: set[str] = set()  # units whose last write found no space
        self._closed = False
        self.bytes_written = 0

    def submit(self, prepared: list) -> None:
        """Queue one step's fields, ``(ref, compact, buffer)`` each (all on one unit), or none of them."""
        nbytes = sum(compact.nbytes for _, compact, _ in prepared)
        unit = prepared[0][0].unit
        with self._cond:
            # One oversized step may go alone; otherwise wait until it fits the bound.
            while not self._closed and self._inflight_bytes and \
                    self._inflight_bytes + nbytes > self._config.writer_inflight_bytes:
                self._cond.wait()
            if self._closed:
                raise ClosedError("Writer is closed")
            for ref, _, _ in prepared:
                if ref.key in self._pending:
                    raise DuplicateKeyError(f"{ref.key} is already being written")
            self._inflight_bytes += nbytes
            self._queued.setdefault(unit, collections.deque()).append(prepared)
            self._pending.update(ref.key for ref, _, _ in prepared)
            # One task a step: a task finding its step taken by an earlier batch has nothing to do.
            self._pool.submit(self._send_queued, unit)

    def give_back(self, buffers) -> None:
        """Return buffers a put took but never queued."""
        for buffer in buffers:
            self.buffers.give(buffer, self._inflight_bytes)

    def _send_queued(self, unit: str) -> None:
        with self._cond:
            queue, steps, nbytes = self._queued.get(unit), [], 0
            while queue and len(steps) < BATCH_STEPS:
                step_bytes = sum(compact.nbytes for _, compact, _ in queue[0])
                if steps and nbytes + step_bytes > BATCH_BYTES:
                    break
                steps.append(queue.popleft())
                nbytes += step_bytes
        if steps:
            self._send_batch(unit, steps)

    def _send_batch(self, unit: str, steps: list) -> None:
        """Send ``steps`` in one request; settle each step (stored whole, or undone and its failure kept)."""
        fields = [field for step in steps for field in step]
        let_go = False
        try:
            # Each field is a block of its own: the largest must fit, as when each went alone.
            largest = max(fields, key=lambda field: field[1].nbytes)
            self._refuse_if_still_full(unit, largest[0].key, largest[1].nbytes)
            results = self._clients.channel(unit).write_many(
                [(ref.key, byte_view(compact), _meta(ref)) for ref, compact, _ in fields],
                timeout=self._config.put_timeout_s)
            let_go = True
        except Exception as exc:  # recorded for flush; a BaseException (interpreter exit) goes on up
            results = [exc] * len(fields)
        if any(isinstance(r, CapacityError) for r in results):
            self._full.add(unit)
        elif let_go:
            self._full.discard(unit)
        outcomes = iter(results)
        for step in steps:
            self._settle(step, [next(outcomes) for _ in step], let_go)

    def _settle(self, step: list, results: list, let_go: bool) -> None:
        """One step's outcome: its buffers back, its keys no longer pending (undone first if a field failed)."""
        stored, failure, written = [], None, 0
        for (ref, compact, _), result in zip(step, results):
            if not isinstance(result, BaseException):
                try:
                    _check_receipt(ref, result)
                    stored.append(ref)
                    written += compact.nbytes
                    continue
                except TransferError as exc:
                    result = exc
            failure = failure or result
        if failure is not None:
            self._undo(stored, failure)
        with self._cond:
            self.bytes_written += written
            for ref, compact, buffer in step:
                self._inflight_bytes -= compact.nbytes
                if failure is not None:
                    self._failures[ref.key] = failure
                # Back in the pool before the key stops being pending: a put right after flush() must find
                # it there, not fault in a fresh one. A failed send may have left the transport holding it.
                if let_go:
                    self.buffers.give(buffer, self._inflight_bytes)
                self._pending.discard(ref.key)
            self._cond.notify_all()

    def _refuse_if_still_full(self, unit: str, key: str, nbytes: int) -> None:
        """Raise ``CapacityError`` at once for a unit whose last write found no space and that has none yet.

        A full unit costs the rollout one put timeout, not one per batch queued
        behind it: each later batch asks for the largest free block first (one
        control call, made only while the unit is full) and waits only if it fits.
        """
        if unit not in self._full:
            return
        stats = self._clients.channel(unit).call("stats", timeout=self._config.control_timeout_s)
        if int(stats["largest_free"]) < nbytes or stats["writers_waiting"]:
            raise CapacityError(f"unit {unit}: no space for key {key!r} ({nbytes} bytes) and the steps queued "
                                f"with it: its last write found it full and its largest free block is "
                                f"{stats['largest_free']} bytes ({stats['writers_waiting']} writers waiting); "
                                f"not waiting again")

    def _undo(self, stored: list, failure: BaseException) -> None:
        """Delete the fields of a failed step that did land: a step is stored whole or not at all."""
        if not stored:
            return
        unit, keys = stored[0].unit, [ref.key for ref in stored]
        try:
            self._clients.channel(unit).call("delete", timeout=self._config.control_timeout_s, keys=keys)
        except Exception as exc:  # the unit is gone with them, or will be: say so with the failure
            add_note(failure, f"gputq: deleting the step's stored keys {keys} from unit {unit} failed: {exc!r}")

    # -- waiting and failures ----------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has landed; raise for those that failed (see ``Writer.flush``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._pending, timeout):
                raise GputqTimeoutError(f"{len(self._pending)} writes still pending after {timeout}s")
        self.raise_failures()

    def wait(self, keys, timeout: float | None = None) -> None:
        """Wait for the writes of ``keys`` only (failures stay recorded)."""
        keys = set(keys)
        with self._cond:
            if not self._cond.wait_for(lambda: not keys.intersection(self._pending), timeout):
                raise GputqTimeoutError(f"writes of {sorted(keys & self._pending)[:8]} still "
                                        f"pending after {timeout}s")

    def failed(self, keys) -> list[str]:
        """Which of ``keys`` failed to land (and are not yet reported), sorted."""
        with self._cond:
            return sorted(set(keys) & set(self._failures))

    def forget(self, keys) -> None:
        """Drop the recorded failures of ``keys`` (they were deleted)."""
        with self._cond:
            for key in keys:
                self._failures.pop(key, None)

    def raise_failures(self) -> None:
        """Raise the failures recorded so far, as one error, and forget them."""
        with self._cond:
            failures, self._failures = self._failures, {}
        if failures:
            first = next(iter(failures.values()))
            error = _one_error(failures, f"{len(failures)} writes failed, first: {first!r}; keys: "
                                         f"{sorted(failures)[:8]}")
            # What each failure noted (a step's keys its undo could not delete) is said with the error raised.
            notes = [note for failure in {id(f): f for f in failures.values()}.values()
                     for note in getattr(failure, "__notes__", ())]
            if notes:  # the error is new: these are all its notes (already logged where notes are not native)
                error.__notes__ = notes
            raise error from first

    def close(self) -> None:
        """Send what is queued, then stop the sender threads; raise the failures not yet reported. Idempotent."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=True)
        self.buffers.clear()
        self.raise_failures()


def _meta(ref: FieldRef) -> dict:
    meta = {"field": ref.field, "dtype": ref.dtype, "rows": ref.rows, "row_shape": list(ref.row_shape),
            "partition": ref.partition, "generation": ref.generation}
    if ref.num_experts:
        meta["num_experts"] = ref.num_experts
    return meta


def _background_priority() -> None:
    """Lower the calling sender thread's CPU priority, where the OS allows it per thread (Linux).

    Sending is background work: when cores are scarce, the thread calling
    ``put`` must win them over the sends of earlier steps. The senders still
    get every core nobody else wants, and a put that finds the in-flight
    bound full leaves them its core while it waits.
    """
    if sys.platform != "linux":  # elsewhere PRIO_PROCESS with a thread id means another process
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + SENDER_NICE))


def _one_error(failures: dict, message: str) -> GputqError:
    """Failed writes as one error, with ``keys`` naming them all: of the most derived class of the tree
    they all are (a full arena's ``CapacityError`` stays a TimeoutError, a ``DuplicateKeyError`` a
    ValueError, a hung unit's first timeout and the fast failures after it a ``UnitLostError``), else a
    ``TransferError``; its ``unit`` is theirs where they all name one."""
    kind = _shared_class([type(exc) for exc in failures.values()])
    error = None
    with contextlib.suppress(TypeError):  # a class whose constructor needs more than a message
        error = kind(message)
    if error is None:
        error = TransferError(message)
    error.keys = tuple(sorted(failures))
    units = {getattr(exc, "unit", None) for exc in failures.values()}
    if isinstance(error, (TransferError, UnitLostError)) and len(units) == 1:
        error.unit = units.pop()
    return error


def _shared_class(kinds: list) -> type:
    """The first class of the first failure's MRO that every failure is, short of ``GputqError`` itself;
    else ``TransferError``."""
    for kind in kinds[0].__mro__:
        if kind is GputqError or not issubclass(kind, GputqError):
            break
        if all(issubclass(other, kind) for other in kinds):
            return kind
    return TransferError


def _check_receipt(ref: FieldRef, receipt) -> None:
    """Refuse a write that landed under another generation or unit incarnation than ``ref`` says.

    Units that report their incarnation in receipts also store the writer's
    generation; a mismatch means the unit restarted since the membership was
    read, or ignored the generation: either way ``ref`` could never be read.
    """
    if not isinstance(receipt, dict) or "incarnation" not in receipt:
        return
    if ref.incarnation and receipt["incarnation"] != ref.incarnation:
        raise TransferError(f"unit {ref.unit} restarted: {ref.key} landed in incarnation "
                            f"{receipt['incarnation']}, the reference is for {ref.incarnation}",
                            unit=ref.unit, keys=[ref.key])
    if receipt.get("generation") != ref.generation:
        raise TransferError(f"unit {ref.unit} stored {ref.key} as generation {receipt.get('generation')}, "
                            f"not the writer's {ref.generation}", unit=ref.unit, keys=[ref.key])


class Buffers:
    """Byte buffers for compact copies, kept after their send for the next put.

    Sizes are rounded up to classes 1/8 of a power of two apart, so steps of
    slightly different lengths share buffers; a buffer is reused for a
    request of at least half its size. Buffers kept plus bytes in flight
    stay within ``limit``; small ones are not kept (malloc reuses them well).
    """

    MIN_BYTES = 64 << 10

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        step = 1 << max(nbytes.bit_length() - 4, 12)
        return -(-nbytes // step) * step

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` bytes (uint8, 1-D)."""
        if nbytes < self.MIN_BYTES:
            return np.empty(nbytes, np.uint8)
        size = self.size_class(nbytes)
        with self._lock:
            for cls in sorted(c for c in self._free if size <= c <= 2 * nbytes):
                buffer = self._free[cls].pop()
                if not self._free[cls]:
                    del self._free[cls]
                self._kept -= buffer.nbytes
                return buffer
        return np.empty(size, np.uint8)

    @property
    def count(self) -> int:
        with self._lock:
            return sum(len(kept) for kept in self._free.values())

    def kept(self) -> list[np.ndarray]:
        """The buffers kept now."""
        with self._lock:
            return [buffer for kept in self._free.values() for buffer in kept]

    def clear(self) -> None:
        """Drop every kept buffer."""
        with self._lock:
            self._free, self._kept = {}, 0

    def give(self, buffer: np.ndarray, inflight: int) -> None:
        """Keep ``buffer`` for reuse if it fits the bound with ``inflight`` bytes queued."""
        if buffer.nbytes < self.MIN_BYTES:
            return
        with self._lock:
            if self._kept + buffer.nbytes + inflight <= self._limit:
                self._free.setdefault(buffer.nbytes, []).append(buffer)
                self._kept += buffer.nbytes
