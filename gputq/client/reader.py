"""Trainer-side reader: pull one data-parallel shard and restore its fields.

For a shard (the layouts of its samples) the reader

1. deduplicates the referenced blobs, so a step shared by many segments is
   fetched once;
2. lays every blob out in one compact staging buffer, unit by unit, each
   field's blobs on whole rows of that field's dtype view;
3. issues one batched read per unit (a few when keys run into thousands or
   bytes past the frame limit), units in parallel, straight into that
   buffer (host memory, the transport's registered memory over rdma, or GPU
   memory with ``device="cuda"``); each read carries its keys' generations
   and the unit's incarnation from the references, so the unit refuses a
   stale reference (``StaleReadError``) instead of returning other bytes;
4. runs one widen-and-scatter per field over the whole shard, into one
   output buffer; each sample's tensor is a view of it. On the host that
   buffer is memory of an earlier fetch whose arrays are all gone, where
   there is one (see :mod:`gputq.client.host_outputs`).

The restored fields are exactly what the non-offloaded path gives:
``rollout_log_probs`` float32 and ``rollout_routed_experts`` int32.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from gputq.client.clients import UnitClients
from gputq.client.host_outputs import HostOutputs
from gputq.client.host_restore import token_major_on_host
from gputq.client.in_place import mapped_staging
from gputq.client.lifecycle import release
from gputq.client.reachability import refuse_lost
from gputq.client.read_context import ReadContext
from gputq.client.shard_plan import FieldStage, ReadRequest, build_plan, lay_out, stage_field
from gputq.client.stream import MicroBatchStream
from gputq.client.stream_plan import plan_stream
from gputq.config import GputqConfig
from gputq.data.fields import sample_key_of
from gputq.data.refs import Layout, checked_shard, uses_by_unit
from gputq.data.slices import ParallelSlice, layer_major
from gputq.errors import ClosedError, HintMissedError, InvalidInputError, LayoutError, TransferError
from gputq.kernels import widen_scatter
from gputq.transport.base import Closeable

__all__ = ["Reader", "FetchStats"]

@dataclass
class FetchStats:
    """What the last :meth:`Reader.fetch` moved."""

    samples: int = 0
    unique_keys: int = 0
    referenced_keys: int = 0
    unique_keys_per_unit: dict = field(default_factory=dict)
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    restore_seconds: float = 0.0

    @property
    def fetch_gbps(self) -> float:
        return self.bytes_fetched / self.fetch_seconds / 1e9 if self.fetch_seconds else 0.0


class Reader(Closeable):
    """Fetches shards for one trainer rank.

    Parameters
    ----------
    clients:
        Channels to the units (one per unit, reused across fetches).
    config:
        Supplies the read timeout.
    device:
        ``"cpu"`` restores into numpy arrays; ``"cuda"`` (or ``"cuda:N"``)
        stages in GPU memory and returns CUDA torch tensors.
    reader_id:
        This reader's identity in release ids (e.g. ``"rank-3"``); a
        random one per Reader when None. Two readers releasing the same
        shard must have different ids; a reader restarted to retry its
        releases keeps its id.
    """

    def __init__(self, clients: UnitClients, config: GputqConfig, device: str = "cpu", *,
                 reader_id: str | None = None):
        self._ctx = ReadContext(clients, config, device)
        if reader_id is None:
            reader_id = uuid.uuid4().hex
        if not isinstance(reader_id, str) or not reader_id:
            self._ctx.close()
            raise InvalidInputError(f"reader_id must be a non-empty str, got {reader_id!r}")
        self.reader_id = reader_id
        self._lock = threading.Lock()
        self._outputs = HostOutputs()
        self._closed = False
        self.last_stats = FetchStats()

    @property
    def device(self) -> str:
        """Where restored fields live: ``"cpu"`` or ``"cuda[:N]"``."""
        return self._ctx.device

    # -- fetching --------------------------------------------------------
    def fetch(self, shard: Sequence[Mapping[str, Layout]]) -> list[dict]:
        """Restore every field of every sample of ``shard``.

        ``shard`` holds, per sample, a mapping of field name to its
        :class:`Layout`. Returns, per sample, slime's field names mapped to
        arrays (numpy on CPU, torch on CUDA) of shape ``[rows, *row_shape]``.
        Host arrays are the caller's for as long as it keeps any of them (or
        a view, or a torch tensor of one); once all of a field's are gone, a
        later fetch restores into that memory again.
        """
        if self._closed:
            raise ClosedError("Reader is closed")
        shard = checked_shard(shard)
        with self._lock:  # one fetch at a time: they share the staging buffers
            return self._fetch(shard)

    def _fetch(self, shard: Sequence[Mapping[str, Layout]]) -> list[dict]:
        per_field = {}
        for name in sorted({name for sample in shard for name in sample}):
            layouts = [sample[name] for sample in shard if name in sample]
            if len(layouts) != len(shard):
                raise LayoutError(f"field {name!r} is missing from some samples of the shard")
            per_field[name] = (layouts, stage_field(name, layouts))
        referenced = sum(len({(f.ref.unit, f.ref.key) for f in layout.fragments})
                         for layouts, _ in per_field.values() for layout in layouts)
        try:
            results, stats = self._fetch_once(per_field, len(shard), ahead=True)
        except HintMissedError:  # a same-host restore ran on a key directory the leases did not confirm
            results, stats = self._fetch_once(per_field, len(shard), ahead=False)
        stats.referenced_keys = referenced
        self.last_stats = stats
        return results

    def _fetch_once(self, per_field: dict, samples: int, *, ahead: bool) -> tuple[list[dict], FetchStats]:
        stats = FetchStats(samples=samples)
        with contextlib.ExitStack() as lent:  # pooled staging goes back once restored
            started = time.perf_counter()
            requests, nbytes = lay_out([stage for _, stage in per_field.values()], self._ctx.config.max_frame_bytes)
            # zero-copy over shm, else None
            staging = mapped_staging(self._ctx, requests, nbytes, stats, lent, ahead=ahead)
            if staging is None:
                staging = self._read_all(requests, nbytes, stats, lent)
            stats.fetch_seconds = time.perf_counter() - started
            started = time.perf_counter()
            results = self._restore(per_field, staging, samples)
            stats.restore_seconds = time.perf_counter() - started
        return results, stats

    def _staging_buffer(self, nbytes: int, units, lent: contextlib.ExitStack):
        """Where a shard's blobs land: transport-registered memory when every unit is read
        over a zero-copy transport (rdma), else this reader's reusable buffer."""
        registered = self._ctx.registered(nbytes, units, lent)
        return self._ctx.buffers.staging(nbytes) if registered is None else registered

    def _read_all(self, requests: list[ReadRequest], nbytes: int, stats: FetchStats, lent: contextlib.ExitStack):
        staging = self._staging_buffer(nbytes, sorted({r.unit for r in requests}), lent)
        for request in requests:
            stats.unique_keys += len(request.keys)
            stats.unique_keys_per_unit[request.unit] = \
                stats.unique_keys_per_unit.get(request.unit, 0) + len(request.keys)
            stats.bytes_fetched += request.stop - request.start
        # Units in parallel, each unit's requests in sequence (parallel streams from one
        # unit only contend for its cores); the largest unit's run in this thread.
        per_unit: dict[str, list] = {}
        for request in requests:
            per_unit.setdefault(request.unit, []).append((request, staging[request.start:request.stop]))
        groups = sorted(per_unit.values(), key=lambda group: sum(dest.nbytes for _, dest in group))
        jobs = [self._ctx.pool.submit(self._read_group, group) for group in groups[:-1]]
        try:
            if groups:
                self._read_group(groups[-1])
        finally:
            wait(jobs)  # no read may still be writing into staging when this returns
        for job in jobs:
            job.result()
        return staging

    def _read_group(self, reads: list) -> None:
        for request, dest in reads:
            self._read(request, dest)

    def _restore(self, per_field: dict, staging, samples: int) -> list[dict]:
        results: list[dict] = [{} for _ in range(samples)]
        for name, (layouts, stage) in per_field.items():
            plan, offsets, total = build_plan(stage, layouts)
            fills = {layout.fill for layout in layouts}
            if len(fills) > 1:
                raise LayoutError(f"field {name!r} has several fill values in one shard: {fills}")
            restored = np.dtype(layouts[0].dtype) if layouts else np.dtype(np.float32)
            nbytes = total * stage.width * restored.itemsize
            out = (self._outputs.take(nbytes) if self._ctx.on_host else self._ctx.buffers.empty(nbytes)).view(restored)
            rows = staging.nbytes // stage.row_bytes  # a view of whole rows from byte 0
            compact = staging[:rows * stage.row_bytes].view(stage.dtype)
            if layer_major(stage.row_shape):
                fill = fills.pop() if fills else 0
                if self._ctx.on_host:
                    token_major_on_host(compact, stage, layouts, offsets, out, fill)
                else:
                    out = self._token_major(compact, plan, stage, out, fill, total)
            else:
                widen_scatter(compact, plan, stage.width, out, fill=fills.pop() if fills else 0)
            out_name = sample_key_of(name)
            for i, (layout, offset) in enumerate(zip(layouts, offsets)):
                view = out[offset * stage.width:(offset + layout.rows) * stage.width]
                results[i][out_name] = self._ctx.to_output(view.reshape((layout.rows, *layout.row_shape)))
        if not self._ctx.on_host:
            self._ctx.synchronize()
        return results

    def _token_major(self, compact, plan, stage: FieldStage, out, fill, total: int):
        """Widen a layer-major field into ``[L, total, ...]`` in device memory, then lay it out token-major in ``out``.

        The whole-shard path pays this second pass (and a second buffer) for
        the ``[T-1, L, K]`` tensors slime's samples hold; streamed
        micro-batches are consumed layer-major and skip it.
        """
        import torch

        inner = stage.width // stage.row_shape[0]
        by_layer = self._ctx.buffers.empty(out.nbytes).view(out.dtype)
        widen_scatter(compact, plan, inner, by_layer, fill=fill)
        shape = (stage.row_shape[0], total, inner)
        self._ctx.synchronize()  # torch's stream runs the transpose
        source, target = torch.from_dlpack(by_layer), torch.from_dlpack(out)
        target.view(total, shape[0], inner).copy_(source.view(shape).permute(1, 0, 2))
        if target.is_cuda and torch.cuda.is_available():  # (a CUDA stand-in's tensors copy synchronously)
            torch.cuda.current_stream(target.device).synchronize()
        return out

    def _read(self, request: ReadRequest, dest) -> None:
        channel = self._ctx.channel(request.unit)
        lengths = channel.read(request.keys, dest, timeout=self._ctx.read_timeout_s,
                               generations=request.generations, incarnation=request.incarnation or None)
        if sum(lengths) != dest.nbytes:
            raise TransferError(f"unit {request.unit} returned {sum(lengths)} bytes for {len(request.keys)} "
                                f"keys, expected {dest.nbytes}", unit=request.unit, keys=request.keys)

    def stream(self, shard: Sequence[Mapping[str, Layout]], micro_batches: Sequence[Sequence[int]],
               rank: ParallelSlice | None = None, *, prefetch: int = 2, release: str | None = None,
               total_lengths: Sequence[int] | None = None, token_ranges=None,
               fields: Sequence[str] | None = None, hold: bool = False) -> MicroBatchStream:
        """Stream ``shard`` to this rank one micro-batch at a time: only its slice, prefetched.

        Parameters
        ----------
        shard:
            Per sample, field name to :class:`Layout` (as for :meth:`fetch`).
        micro_batches:
            The trainer's split: lists of shard positions that together hold
            every sample exactly once.
        rank:
            This rank's layers and CP/TP position (default: everything).
        prefetch:
            Micro-batches fetched ahead of the one being consumed (>= 1).
        release:
            A partition: drop each micro-batch's references once the
            consumer moves past it (as :meth:`release`); ``None``: keep them.
        total_lengths:
            Each sample's ``len(tokens)``; checked against R3's rows
            (``T - 1``), and needed to cut logprobs for CP without R3.
        token_ranges:
            Per sample, R3 row ranges to read instead of the CP rule.
        fields:
            The fields to read (default: all the samples have); a pipeline
            stage before the last, say, replays R3 but computes no loss.
        hold:
            Keep every yielded micro-batch until its ``release()`` (a
            pipeline schedule's several forwards before their backwards);
            by default each goes (its tensors invalid) at the next.

        Returns
        -------
        MicroBatchStream
            An iterator of :class:`~gputq.client.stream.MicroBatch`; close
            it (or use it as a context manager) to stop prefetching early.

        Raises
        ------
        InvalidInputError
            Before anything is read: micro-batches that do not partition the
            shard, a prefetch depth below 1, layers outside the stored ones,
            a token range outside its sample, R3 rows that are not
            ``len(tokens) - 1``; each names the sample or micro-batch.
        UnitLostError
            Before anything is read: a unit of some samples is known lost.
        """
        if self._closed:
            raise ClosedError("Reader is closed")
        _check_stream_options(prefetch, release, fields, hold)
        rank = ParallelSlice() if rank is None else rank
        shard = checked_shard(shard)
        plans = plan_stream(shard, micro_batches, rank, total_lengths=total_lengths, token_ranges=token_ranges,
                            fields=fields, max_bytes=self._ctx.config.max_frame_bytes)
        refuse_lost(shard, self._ctx.clients.lost)
        return MicroBatchStream(self._ctx, plans, prefetch, rank, hold=hold,
                                release=None if release is None else functools.partial(self._release_micro_batch,
                                                                                      release))

    def release(self, shard: Sequence[Mapping[str, Layout]], partition: str, *,
                release_id: str | None = None) -> dict:
        """Drop the references the samples of ``shard`` hold: they are consumed.

        One reference per sample and key, the count
        :meth:`Writer.finalize` gave them, so ranks sharing steps release
        independently and a step is freed when its last segment is done.
        Keys already gone (the rollout released meanwhile) are skipped.

        Exactly once: each unit applies a given ``release_id`` once, so a
        retried or repeated release of the same shard frees nothing more
        (other ranks' references survive). The default id is this reader's
        ``reader_id`` and a digest of the shard's uses (unit, key, count)
        and ``partition``; pass one to tie a release to something else,
        e.g. a training step.

        Every unit of the shard is asked, in parallel; a lost unit does not
        keep the others from freeing their keys, and a retry with the same
        ``release_id`` once it is back frees its keys and nothing more
        elsewhere. Returns and raises as
        :func:`~gputq.client.lifecycle.release` does: ``{"freed": keys
        freed, "unreachable": {}}``, or ``PartialFailureError`` with that as
        ``.result`` after every reachable unit released its keys.
        """
        uses = uses_by_unit(checked_shard(shard))
        if release_id is None:
            release_id = self._default_release_id(uses, partition)
        elif not isinstance(release_id, str) or not release_id:
            raise InvalidInputError(f"release_id must be a non-empty str, got {release_id!r}")
        return release(uses, partition, self._ctx.clients, missing_ok=True, release_id=release_id,
                       timeout=self._ctx.config.control_timeout_s,
                       what=f"release of a shard of partition {partition!r}")

    def _release_micro_batch(self, partition: str, layouts: list, index: int) -> None:
        """Drop a streamed micro-batch's references (its index in the id: two micro-batches with the
        same uses are two releases)."""
        release_id = self._default_release_id(uses_by_unit(layouts), partition) + f"/mb{index}"
        self.release(layouts, partition, release_id=release_id)

    def _default_release_id(self, uses: Mapping[str, list[str]], partition: str) -> str:
        """The default release id of a shard: ``reader_id`` and a digest of its ``uses`` per unit."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr(partition).encode())
        for unit in sorted(uses):
            for key, count in sorted(Counter(uses[unit]).items()):
                digest.update(repr((unit, key, count)).encode())
        return f"{self.reader_id}/{digest.hexdigest()}"

    def close(self) -> None:
        """Stop the read threads. Idempotent; the clients stay open."""
        if not self._closed:
            self._closed = True
            self._ctx.close()
            self._outputs.close()


def _check_stream_options(prefetch, release, fields, hold) -> None:
    """Refuse a stream option of the wrong type or range (``InvalidInputError``)."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise InvalidInputError(f"prefetch must be an int >= 1, got {prefetch!r}")
    if release is not None and (not isinstance(release, str) or not release):
        raise InvalidInputError(f"release must be a partition name or None, got {release!r}")
    if fields is not None and (isinstance(fields, str) or not all(isinstance(f, str) for f in fields)):
        raise InvalidInputError(f"fields must be a list of field names, got {fields!r}")
    if not isinstance(hold, bool):
        raise InvalidInputError(f"hold must be a bool, got {hold!r}")


