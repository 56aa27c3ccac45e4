"""Rollout-side writer: canonicalise, place, and send fields in the background.

``put`` runs on the rollout proxy's critical path, once per model call, so
it costs about one pass over the step on the caller's thread: each field is
checked and compacted in one cache-friendly pass straight into a buffer the
writer owns (so a bad expert ID fails right there, naming the key, and the
caller may reuse its arrays at once). It returns the
:class:`~gputq.data.refs.FieldRef` of every field at once, each carrying the
unit's incarnation and a fresh random generation for the key, and hands the
buffers to the writer's :class:`~gputq.client.sends.SendQueue`, whose
sender threads send each unit's queued steps in batches. The bytes go to
the unit over the transport, never through Ray. Queued bytes are bounded:
``put`` blocks while ``writer_inflight_bytes`` are still unsent.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Iterator, Mapping

import numpy as np

from gputq.client.clients import UnitClients
from gputq.client.fanout import fan_out, tally
from gputq.client.placement import rendezvous_unit
from gputq.client.sends import SendQueue
from gputq.config import GputqConfig
from gputq.data.canonical import canonicalize
from gputq.data.fields import FieldRegistry, logprobs_spec, routed_experts_spec, row_nbytes
from gputq.data.keys import checked_name
from gputq.data.refs import FieldRef, uses_by_unit
from gputq.data.slices import layer_major
from gputq.errors import (ClosedError, FieldValueError, GputqError, InvalidInputError, RequestTooLargeError,
                          TransferError, add_note)
from gputq.transport.base import Closeable

__all__ = ["Writer", "CommitRegion", "stored_key"]


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
        self._sends = SendQueue(clients, config)
        self._expert_specs: dict[tuple, object] = {}
        self._closed = False

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
                buffer = self._sends.buffers.take(arr.shape[0] * row_nbytes(spec) if arr.ndim else 0)
                taken.append(buffer)
                # Rows of two or more dimensions go layer-major: a pipeline stage's layers are then
                # one contiguous run each, whatever tokens its rank reads.
                compact = canonicalize(key, spec, arr, out=buffer, layer_major=layer_major(spec.row_shape))
                ref = FieldRef(stored_key(key, field), field, unit, arr.shape[0], spec.dtype,
                               spec.row_shape, partition, incarnation, secrets.randbits(63) or 1, spec.num_experts,
                               spec.id_limit)
                prepared.append((ref, compact, buffer))
            self._sends.submit(prepared)
        except BaseException:
            self._sends.give_back(taken)
            raise
        return {ref.field: ref for ref, _, _ in prepared}

    def _check_fits(self, key: str, arrays: dict, specs: dict) -> None:
        """Refuse a step that no unit's arena could ever hold whole (``RequestTooLargeError``)."""
        sizes = {field: arr.shape[0] * row_nbytes(specs[field]) if arr.ndim else 0 for field, arr in arrays.items()}
        if sum(sizes.values()) > self._config.unit_capacity_bytes:
            raise RequestTooLargeError(f"key {key!r}: its fields need {sum(sizes.values())} bytes ({sizes}), more "
                                       f"than a unit's arena of {self._config.unit_capacity_bytes}; nothing was stored")

    @property
    def buffers_kept(self) -> int:
        """Sent buffers kept for reuse now. It grows to what the sends in flight at once
        needed, each new one faulted in by a put; a steady stream of puts stops it growing."""
        return self._sends.buffers.count

    @property
    def bytes_written(self) -> int:
        """Bytes of the fields stored so far."""
        return self._sends.bytes_written

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has landed.

        Raises for the writes that failed (and forgets them): an error of
        the most derived class they share (``CapacityError``,
        ``DuplicateKeyError``, ``UnitLostError`` for a hung unit's timeout
        and the fast failures after it, ...), else a ``TransferError``; its
        ``keys`` name every key of the failed steps, its ``unit`` theirs
        where they all name one.
        Raises ``GputqTimeoutError`` if writes are still pending.
        """
        self._sends.flush(timeout)

    def wait(self, keys, timeout: float | None = None) -> None:
        """Wait for the writes of ``keys`` only (failures stay recorded)."""
        self._sends.wait(keys, timeout)

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
        failed = self._sends.failed(written)
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
        self._sends.forget(k for keys in by_unit.values() for k in keys)

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
                add_note(exc, f"gputq: rolling back {len(region.refs)} keys also failed: {rollback_exc!r}")
            raise

    def close(self) -> None:
        """Send what is queued, then stop the sender threads. Idempotent.

        Raises, as :meth:`flush` does, for the writes that failed and were
        not yet reported by it: a ref handed out must not silently point at
        nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._sends.close()

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except GputqError as failure:  # failed writes, of whichever class they share
            if exc is None:
                raise
            add_note(exc, f"gputq: writes also failed: {failure}")


_LOGPROBS = logprobs_spec()


def _as_array(key: str, field: str, value) -> np.ndarray:
    """``value`` as one numpy array, or ``FieldValueError`` (ragged nesting, mixed objects)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise FieldValueError(f"key {key!r} field {field!r}: not an array of one shape and dtype "
                              f"({type(exc).__name__}: {exc})") from None


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
