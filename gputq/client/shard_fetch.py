"""The whole-shard fetch: the read plan's special case of one micro-batch holding the whole shard.

For a shard (the layouts of its samples) :class:`ShardFetch`

1. plans it with :func:`~gputq.client.plan.plan_shard`, the stream's
   planner: each referenced key once (a step shared by many segments is
   fetched once), laid out in one compact staging buffer, unit by unit,
   each field's keys on whole rows of that field's dtype view, read whole
   (by name, not by spans);
2. issues one batched read per unit (a few when keys run into thousands or
   bytes past the frame limit), units in parallel, straight into that
   buffer (host memory, the transport's registered memory over rdma, or GPU
   memory with ``device="cuda"``), or, over shm, reads the units' arenas in
   place; each read carries its keys' generations and the unit's
   incarnation from the references, so the unit refuses a stale reference
   (``StaleReadError``) instead of returning other bytes;
3. restores each field over the whole shard into one output buffer, each
   sample's tensor a view of it: R3 token-major (``[rows, L, K]``, as
   slime's samples hold it), widened and transposed at once on the host.
   On the host that buffer is memory of an earlier fetch whose arrays are
   all gone, where there is one (see :mod:`gputq.client.host_outputs`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from gputq.client.fetch import read_requests
from gputq.client.host_outputs import HostOutputs
from gputq.client.host_restore import token_major_on_host
from gputq.client.in_place import mapped_staging
from gputq.client.plan import MicroPlan, plan_shard
from gputq.client.plan_fields import FieldPlan
from gputq.client.read_context import ReadContext
from gputq.data.fields import sample_key_of
from gputq.data.refs import Layout
from gputq.errors import HintMissedError
from gputq.kernels import restore_scatter

__all__ = ["FetchStats", "ShardFetch"]


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


class ShardFetch:
    """Fetches and restores whole shards through a reader's context and host outputs (one fetch at a time)."""

    def __init__(self, ctx: ReadContext, outputs: HostOutputs):
        self._ctx, self._outputs = ctx, outputs

    def __call__(self, shard: Sequence[Mapping[str, Layout]]) -> tuple[list[dict], FetchStats]:
        """Every field of every sample of the checked ``shard``, and what the fetch moved."""
        return self._fetch(shard)

    def _fetch(self, shard: Sequence[Mapping[str, Layout]]) -> tuple[list[dict], FetchStats]:
        if not shard:
            return [], FetchStats()
        plan = plan_shard(shard, self._ctx.config.max_frame_bytes)
        try:
            results, stats = self._fetch_once(plan, ahead=True)
        except HintMissedError:  # a same-host restore ran on a key directory the leases did not confirm
            results, stats = self._fetch_once(plan, ahead=False)
        stats.referenced_keys = sum(len({(f.ref.unit, f.ref.key) for f in layout.fragments})
                                    for sample in shard for layout in sample.values())
        return results, stats

    def _fetch_once(self, plan: MicroPlan, *, ahead: bool) -> tuple[list[dict], FetchStats]:
        stats = FetchStats(samples=len(plan.samples))
        with contextlib.ExitStack() as lent:  # pooled staging goes back once restored
            started = time.perf_counter()
            # zero-copy over shm, else None; the unpack kernel reads plain staging in device memory only
            device_unpack = not self._ctx.on_host and any(fp.packing for fp in plan.fields.values())
            staging = None if device_unpack else mapped_staging(self._ctx, plan.requests, plan.nbytes, stats, lent,
                                                                ahead=ahead)
            if staging is None:
                staging = self._read_all(plan, stats, lent)
            stats.fetch_seconds = time.perf_counter() - started
            started = time.perf_counter()
            results = self._restore(plan, staging)
            stats.restore_seconds = time.perf_counter() - started
        return results, stats

    def _staging_buffer(self, nbytes: int, units, lent: contextlib.ExitStack):
        """Where a shard's blobs land: transport-registered memory when every unit is read
        over a zero-copy transport (rdma), else this reader's reusable buffer."""
        registered = self._ctx.registered(nbytes, units, lent)
        return self._ctx.buffers.staging(nbytes) if registered is None else registered

    def _read_all(self, plan: MicroPlan, stats: FetchStats, lent: contextlib.ExitStack):
        staging = self._staging_buffer(plan.nbytes, list(plan.units), lent)
        for request in plan.requests:
            stats.unique_keys += len(request.keys)
            stats.unique_keys_per_unit[request.unit] = \
                stats.unique_keys_per_unit.get(request.unit, 0) + len(request.keys)
            stats.bytes_fetched += request.stop - request.start
        read_requests(self._ctx, plan.requests, staging)
        return staging

    def _restore(self, plan: MicroPlan, staging) -> list[dict]:
        results: list[dict] = [{} for _ in plan.samples]
        for name, fp in plan.fields.items():
            nbytes = fp.out_elements * fp.restored.itemsize
            out = self._outputs.take(nbytes) if self._ctx.on_host else self._ctx.buffers.empty(nbytes)
            out = out.view(fp.restored)
            rows = staging.nbytes // fp.row_bytes  # a view of whole rows from byte 0
            compact = staging[:rows * fp.row_bytes].view(fp.stored)
            if fp.layers:  # R3, restored token-major
                if self._ctx.on_host:
                    token_major_on_host(compact, fp, out)
                else:
                    out = self._token_major(compact, fp, out)
            else:
                restore_scatter(compact, fp.plan, fp.width, out, fp.fill, packing=fp.packing)
            row_elements = fp.out_elements // max(fp.tokens, 1)
            out_name, first = sample_key_of(name), 0
            for i, layout in enumerate(plan.layouts):
                view = out[first * row_elements:(first + layout[name].rows) * row_elements]
                results[i][out_name] = self._ctx.to_output(view.reshape((layout[name].rows, *layout[name].row_shape)))
                first += layout[name].rows
        if not self._ctx.on_host:
            self._ctx.synchronize()
        return results

    def _token_major(self, compact, fp: FieldPlan, out):
        """Widen a layer-major field into ``[L, tokens, ...]`` in device memory, then lay it out token-major in
        ``out``.

        The whole-shard path pays this second pass (and a second buffer) for
        the ``[T-1, L, K]`` tensors slime's samples hold; streamed
        micro-batches are consumed layer-major and skip it.
        """
        import torch

        by_layer = self._ctx.buffers.empty(out.nbytes).view(out.dtype)
        restore_scatter(compact, fp.plan, fp.width, by_layer, fp.fill, packing=fp.packing)
        shape = (len(fp.layers), fp.tokens, fp.width)
        self._ctx.synchronize()  # torch's stream runs the transpose
        source, target = torch.from_dlpack(by_layer), torch.from_dlpack(out)
        target.view(fp.tokens, shape[0], fp.width).copy_(source.view(shape).permute(1, 0, 2))
        if target.is_cuda and torch.cuda.is_available():  # (a CUDA stand-in's tensors copy synchronously)
            torch.cuda.current_stream(target.device).synchronize()
        return out
