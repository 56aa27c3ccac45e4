"""Rollout-side writer: canonicalise, place, and send fields in the background.

``put`` runs on the rollout proxy's critical path, once per model call, so
it costs about one pass over the step on the caller's thread: each field is
checked and compacted in one cache-friendly pass straight into a buffer the
writer owns (so a bad expert ID fails right there, naming the key, and the
caller may reuse its arrays at once). It returns the
:class:`~gputq.data.refs.FieldRef` of every field at once, each carrying the
unit's incarnation and a fresh random generation for the key, and hands the
buffers to sender threads. The bytes go to the unit over the transport,
never through Ray. Queued bytes are bounded: ``put`` blocks while
``writer_inflight_bytes`` are still unsent; that bound is the only way the
senders can hold the caller up. The senders also run at a lower CPU
priority than the caller, so on a busy host their socket copies do not take
the core a put needs.

Sent buffers are kept for reuse (within the same byte bound): a fresh
buffer of a large step costs the kernel a page fault per 4 KiB, which would
double the cost of a put and make its tail.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Mapping

import numpy as np

from gputq.client.clients import UnitClients
from gputq.client.fanout import fan_out, tally
from gputq.client.placement import rendezvous_unit
from gputq.config import GputqConfig
from gputq.data.fields import FieldRegistry, canonicalize, logprobs_spec, routed_experts_spec, row_nbytes
from gputq.data.keys import checked_name
from gputq.data.refs import FieldRef, uses_by_unit
from gputq.data.slices import layer_major
from gputq.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    FieldValueError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    RequestTooLargeError,
    TransferError,
)
from gputq.transport.base import Closeable, byte_view

__all__ = ["Writer", "CommitRegion", "SENDER_NICE", "stored_key"]


def stored_key(step_key: str, field: str) -> str:
    """The unit-side key of one field of one step."""
    return f"{step_key}/{field}"


class Writer(Closeable):
    """Puts the large fields of each step into StorageUnits.

    Parameters
    ----------
    clients:
        Channels to the deployment's units; placement uses their names.
    config:
        Supplies ``routed_experts_dtype``, timeouts and the in-flight bound.
    registry:
        Field specs beyond the built-in ``logprobs`` and ``routed_experts``.
    """

    def __init__(self, clients: UnitClients, config: GputqConfig,
                 registry: FieldRegistry | None = None):
        self._clients = clients
        self._config = config
        self._registry = registry
        self._pool = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="gputq-writer",
                                        initializer=_background_priority)
        self._buffers = _Buffers(config.writer_inflight_bytes)
        self._expert_specs: dict[tuple, object] = {}
        self._cond = threading.Condition()
        self._inflight_bytes = 0
        self._pending: dict[str, Future] = {}
        self._failures: dict[str, BaseException] = {}
        self._full: set[str] = set()  # units whose last write found no space
        self._closed = False
        self.bytes_written = 0

    # -- specs -----------------------------------------------------------
    def _spec(self, field: str, array: np.ndarray):
        if self._registry is not None and field in self._registry:
            return self._registry.get(field)
        if field == "logprobs":
            return _LOGPROBS
        if field == "routed_experts":
            if np.ndim(array) != 3:
                raise InvalidInputError(
                    f"routed_experts must be [rows, num_layers, topk], got shape {np.shape(array)}")
            shape = np.shape(array)[1:]
            spec = self._expert_specs.get(shape)
            if spec is None:  # a FieldSpec costs tens of microseconds to build: once per shape
                spec = routed_experts_spec(shape[0], shape[1], self._config.routed_experts_dtype,
                                           self._config.num_experts)
                self._expert_specs[shape] = spec
            return spec
        raise InvalidInputError(f"no field spec for {field!r}; register it in a FieldRegistry")

    # -- writing ---------------------------------------------------------
    def put(self, key: str, partition: str, fields: Mapping[str, np.ndarray]) -> dict[str, FieldRef]:
        """Store ``fields`` of step ``key`` in rollout ``partition``.

        Returns the references at once; bytes are sent in the background.
        Raises ``FieldValueError`` (a ValueError) before anything is sent if
        any field cannot be stored exactly, ``RequestTooLargeError`` if the
        step cannot fit a unit's arena, ``InvalidInputError`` for a key,
        partition or ``fields`` that is not of the documented types. A put
        stores all its fields or none: if one fails to land, those of the
        step already stored are deleted before :meth:`flush` reports it.
        The caller may reuse its arrays as soon as this returns.
        """
        if self._closed:
            raise ClosedError("Writer is closed")
        key, partition = checked_name(key, "key"), checked_name(partition, "partition")
        if not isinstance(fields, Mapping):
            raise InvalidInputError(f"{key}: fields must be a mapping of field name to array, got "
                                    f"{type(fields).__name__}")
        if not fields:
            raise InvalidInputError(f"{key}: no fields to put")
        arrays = {checked_name(field, f"{key}: a field name"): _as_array(key, field, array)
                  for field, array in fields.items()}
        unit = rendezvous_unit(key, self._clients.live_units)
        incarnation = self._clients.membership[unit].get("incarnation", "")
        specs = {field: self._spec(field, arr) for field, arr in arrays.items()}
        self._check_fits(key, arrays, specs)
        prepared: list[tuple[FieldRef, np.ndarray, np.ndarray]] = []
        taken: list[np.ndarray] = []
        try:
            for field, arr in arrays.items():
                spec = specs[field]
                # The one pass: checked and compacted straight into a buffer the writer owns.
                buffer = self._buffers.take(arr.shape[0] * row_nbytes(spec) if arr.ndim else 0)
                taken.append(buffer)
                # Rows of two or more dimensions go layer-major: a pipeline stage's layers are then
                # one contiguous run each, whatever tokens its rank reads.
                compact = canonicalize(key, spec, arr, out=buffer, layer_major=layer_major(spec.row_shape))
                ref = FieldRef(stored_key(key, field), field, unit, arr.shape[0], spec.dtype,
                               spec.row_shape, partition, incarnation, secrets.randbits(63) or 1, spec.num_experts)
                prepared.append((ref, compact, buffer))
            self._submit(prepared)
        except BaseException:
            for buffer in taken:
                self._buffers.give(buffer, self._inflight_bytes)
            raise
        return {ref.field: ref for ref, _, _ in prepared}

    def _check_fits(self, key: str, arrays: dict, specs: dict) -> None:
        """Refuse a step that no unit's arena could ever hold whole (``RequestTooLargeError``)."""
        sizes = {field: arr.shape[0] * row_nbytes(specs[field]) if arr.ndim else 0 for field, arr in arrays.items()}
        if sum(sizes.values()) > self._config.unit_capacity_bytes:
            raise RequestTooLargeError(f"key {key!r}: its fields need {sum(sizes.values())} bytes ({sizes}), more "
                                       f"than a unit's arena of {self._config.unit_capacity_bytes}; nothing was stored")

    def _submit(self, prepared: list) -> None:
        """Queue every field of one put, or none of them."""
        nbytes = sum(compact.nbytes for _, compact, _ in prepared)
        with self._cond:
            # One oversized put may go alone; otherwise wait until it fits the bound.
            while not self._closed and self._inflight_bytes and \
                    self._inflight_bytes + nbytes > self._config.writer_inflight_bytes:
                self._cond.wait()
            if self._closed:
                raise ClosedError("Writer is closed")
            for ref, _, _ in prepared:
                if ref.key in self._pending:
                    raise DuplicateKeyError(f"{ref.key} is already being written")
            self._inflight_bytes += nbytes
            future = self._pool.submit(self._send_all, prepared)  # one hand-off per put, not per field
            for ref, _, _ in prepared:
                self._pending[ref.key] = future

    def _send_all(self, prepared: list) -> None:
        """Send one put's fields in order: once one fails, the rest are not sent and those already stored
        are deleted, before any of the step's keys stops being pending (a flush then sees the step gone)."""
        stored, failure = [], None
        for ref, compact, buffer in prepared:
            attempted, let_go = failure is None, False
            if attempted:
                let_go, failure = self._send(ref, compact)
                if failure is None:
                    stored.append(ref)
            with self._cond:
                self._inflight_bytes -= compact.nbytes
                # Back in the pool before the key stops being pending: a put right after flush() must find
                # it there, not fault in a fresh one. A failed send may have left the transport holding it.
                if let_go or not attempted:
                    self._buffers.give(buffer, self._inflight_bytes)
        if failure is not None:
            self._undo(stored, failure)
        with self._cond:
            for ref, _, _ in prepared:
                if failure is not None:
                    self._failures[ref.key] = failure
                self._pending.pop(ref.key, None)
            self._cond.notify_all()

    def _send(self, ref: FieldRef, compact: np.ndarray) -> tuple[bool, Exception | None]:
        """Write one field: (whether the transport let go of its buffer, the failure or None)."""
        meta = {"field": ref.field, "dtype": ref.dtype, "rows": ref.rows,
                "row_shape": list(ref.row_shape), "partition": ref.partition, "generation": ref.generation}
        if ref.num_experts:
            meta["num_experts"] = ref.num_experts
        let_go = False
        try:
            self._refuse_if_still_full(ref, compact.nbytes)
            receipt = self._clients.channel(ref.unit).write(ref.key, byte_view(compact), meta,
                                                            timeout=self._config.put_timeout_s)
            let_go = True
            _check_receipt(ref, receipt)
        except Exception as exc:  # recorded for flush; a BaseException (interpreter exit) goes on up
            if isinstance(exc, CapacityError):
                self._full.add(ref.unit)
            return let_go, exc
        with self._cond:
            self.bytes_written += compact.nbytes
            self._full.discard(ref.unit)
        return True, None

    def _refuse_if_still_full(self, ref: FieldRef, nbytes: int) -> None:
        """Raise ``CapacityError`` at once for a unit whose last write found no space and that has none yet.

        A full unit costs the rollout one put timeout, not one per step queued
        behind it: each later write asks for the largest free block first (one
        control call, made only while the unit is full) and waits only if it fits.
        """
        if ref.unit not in self._full:
            return
        stats = self._clients.channel(ref.unit).call("stats", timeout=self._config.control_timeout_s)
        if int(stats["largest_free"]) < nbytes or stats["writers_waiting"]:
            raise CapacityError(f"unit {ref.unit}: no space for key {ref.key!r} ({nbytes} bytes): its last write "
                                f"found it full and its largest free block is {stats['largest_free']} bytes "
                                f"({stats['writers_waiting']} writers waiting); not waiting again")

    def _undo(self, stored: list, failure: BaseException) -> None:
        """Delete the fields of a failed step that did land: a step is stored whole or not at all."""
        by_unit: dict[str, list[str]] = {}
        for ref in stored:
            by_unit.setdefault(ref.unit, []).append(ref.key)
        for unit, keys in by_unit.items():
            try:
                self._clients.channel(unit).call("delete", timeout=self._config.control_timeout_s, keys=keys)
            except Exception as exc:  # the unit is gone with them, or will be: say so with the failure
                failure.add_note(f"gputq: deleting the step's stored keys {keys} from unit {unit} failed: {exc!r}")

    @property
    def buffers_kept(self) -> int:
        """Sent buffers kept for reuse now. It grows to what the sends in flight at once
        needed, each new one faulted in by a put; a steady stream of puts stops it growing."""
        return self._buffers.count

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has landed.

        Raises for the writes that failed (and forgets them): an error of
        their own class where they share one (``CapacityError``,
        ``DuplicateKeyError``, ``UnitLostError``, ...), else a
        ``TransferError``; its ``keys`` name every key of the failed steps.
        Raises ``GputqTimeoutError`` if writes are still pending.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not self._pending, timeout):
                raise GputqTimeoutError(f"{len(self._pending)} writes still pending after {timeout}s")
        self._raise_failures()

    def _raise_failures(self) -> None:
        with self._cond:
            failures, self._failures = self._failures, {}
        if failures:
            first = next(iter(failures.values()))
            raise _one_error(failures, f"{len(failures)} writes failed, first: {first!r}; keys: "
                                       f"{sorted(failures)[:8]}") from first

    def wait(self, keys, timeout: float | None = None) -> None:
        """Wait for the writes of ``keys`` only (failures stay recorded)."""
        keys = set(keys)
        with self._cond:
            if not self._cond.wait_for(lambda: not keys.intersection(self._pending), timeout):
                raise GputqTimeoutError(f"writes of {sorted(keys & set(self._pending))[:8]} still "
                                        f"pending after {timeout}s")

    def finalize(self, samples, partition: str, *, readers: int = 1) -> None:
        """Hand the stored steps' lifetime over to the segments built from them.

        Each key gets ``readers`` references of ``partition`` per sample
        (segment) that uses it, and loses the reference its write held. From then on
        a key lives exactly as long as some segment needs it: releasing a
        filtered-out sample (:meth:`Reader.release`) frees what only it
        used, at once; a step shared by several segments is freed when the
        last of them is released; ``release_partition`` still frees all.
        Call it once per segment, after composing (it waits for the writes
        of these keys to land).

        Every unit of the samples is served in parallel: a lost unit does
        not keep the others from finalizing their keys.

        Parameters
        ----------
        samples:
            Per segment, its mapping of field name to :class:`Layout`.
        partition:
            The rollout that wrote the keys.
        readers:
            Ranks that each consume (and release) every sample: with
            streamed micro-batches every rank of a data-parallel group
            (PP x CP x TP of them) releases what it consumed, and a step is
            freed once the last of them is past it.

        Raises
        ------
        InvalidInputError
            ``readers`` is not an int >= 1.
        TransferError
            A write of one of these keys failed; nothing was finalized.
        PartialFailureError
            Some units were unreachable; raised after every other unit
            finalized its keys, with ``{"finalized": keys finalized,
            "unreachable": {unit: reason}}`` as ``.result``. The keys on an
            unreachable unit keep their write references (its rollout's
            ``release_partition`` frees them).
        GputqError
            A unit's own answer (``UnknownKeyError``: a key is gone, its
            rollout released meanwhile), raised after the other units
            finalized theirs.
        """
        if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
            raise InvalidInputError(f"readers must be an int >= 1, got {readers!r}")
        uses = uses_by_unit(samples)
        written = {key for keys in uses.values() for key in keys}
        self.wait(sorted(written))
        with self._cond:
            failed = sorted(written & set(self._failures))
        if failed:
            raise TransferError(f"cannot finalize: writes of {failed[:8]} failed", keys=failed)
        tally(fan_out(uses, lambda unit: self._finalize_on(unit, uses[unit] * readers, partition)),
              f"finalize of partition {partition!r}", "finalized")

    def _finalize_on(self, unit: str, keys: list, partition: str) -> int:
        """One unit's part of :meth:`finalize`: the segments' references on, the writes' off."""
        channel, timeout = self._clients.channel(unit), self._config.control_timeout_s
        # Segment references first: the count never touches zero in between.
        channel.call("add_ref", timeout=timeout, keys=keys, partition=partition)
        written = sorted(set(keys))
        channel.call("release", timeout=timeout, keys=written, partition=partition)
        return len(written)

    def delete(self, refs) -> None:
        """Remove the stored blobs of ``refs`` regardless of who references them."""
        by_unit: dict[str, list[str]] = {}
        for ref in refs:
            by_unit.setdefault(ref.unit, []).append(ref.key)
        self.wait([k for keys in by_unit.values() for k in keys])
        for unit, keys in by_unit.items():
            self._clients.channel(unit).call("delete", timeout=self._config.control_timeout_s, keys=keys)
        with self._cond:
            for keys in by_unit.values():
                for key in keys:
                    self._failures.pop(key, None)

    @contextlib.contextmanager
    def commit_region(self) -> Iterator["CommitRegion"]:
        """Writes and the caller's local commit, all or nothing.

        Put through the yielded region, then do the local commit in the
        body. If the body raises, every key written in it is deleted from
        its unit before the exception propagates.
        """
        region = CommitRegion(self)
        try:
            yield region
        except BaseException as exc:
            try:
                region.rollback()
            except Exception as rollback_exc:  # the caller's error stays the one raised
                exc.add_note(f"gputq: rolling back {len(region.refs)} keys also failed: {rollback_exc!r}")
            raise

    def close(self) -> None:
        """Send what is queued, then stop the sender threads. Idempotent.

        Raises, as :meth:`flush` does, for the writes that failed and were
        not yet reported by it: a ref handed out must not silently point at
        nothing.
        """
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=True)
        self._buffers.clear()
        self._raise_failures()

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except GputqError as failure:  # failed writes, of whichever class they share
            if exc is None:
                raise
            exc.add_note(f"gputq: writes also failed: {failure}")


_LOGPROBS = logprobs_spec()

#: How much lower the sender threads' CPU priority is than the caller's (Linux nice steps).
SENDER_NICE = 10


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
    """Failed writes as one error, with ``keys`` naming them all: of the failures' own class where they
    share one (a full arena's ``CapacityError`` stays a TimeoutError, a ``DuplicateKeyError`` a
    ValueError), else a ``TransferError``."""
    kinds = {type(exc) for exc in failures.values()}
    kind = kinds.pop() if len(kinds) == 1 else TransferError
    error = None
    if issubclass(kind, GputqError):
        with contextlib.suppress(TypeError):  # a class whose constructor needs more than a message
            error = kind(message)
    if error is None:
        error = TransferError(message)
    error.keys = tuple(sorted(failures))
    return error


def _as_array(key: str, field: str, value) -> np.ndarray:
    """``value`` as one numpy array, or ``FieldValueError`` (ragged nesting, mixed objects)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise FieldValueError(f"key {key!r} field {field!r}: not an array of one shape and dtype "
                              f"({type(exc).__name__}: {exc})") from None


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


class _Buffers:
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


class CommitRegion:
    """The keys written inside one :meth:`Writer.commit_region`."""

    def __init__(self, writer: Writer):
        self._writer = writer
        self.refs: list[FieldRef] = []

    def put(self, key: str, partition: str, fields: Mapping[str, np.ndarray]) -> dict[str, FieldRef]:
        refs = self._writer.put(key, partition, fields)
        self.refs.extend(refs.values())
        return refs

    def rollback(self) -> None:
        if self.refs:
            self._writer.delete(self.refs)
            self.refs = []
