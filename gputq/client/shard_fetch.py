"""The whole-shard fetch: every blob of a shard read once into one staging buffer, then restored per field.

For a shard (the layouts of its samples) :class:`ShardFetch`

1. deduplicates the referenced blobs, so a step shared by many segments is
   fetched once;
2. lays every blob out in one compact staging buffer, unit by unit, each
   field's blobs on whole rows of that field's dtype view;
3. issues one batched read per unit (a few when keys run into thousands or
   bytes past the frame limit), units in parallel, straight into that
   buffer (host memory, the transport's registered memory over rdma, or GPU
   memory with ``device="cuda"``), or, over shm, reads the units' arenas in
   place; each read carries its keys' generations and the unit's
   incarnation from the references, so the unit refuses a stale reference
   (``StaleReadError``) instead of returning other bytes;
4. runs one widen-and-scatter per field over the whole shard, into one
   output buffer; each sample's tensor is a view of it. On the host that
   buffer is memory of an earlier fetch whose arrays are all gone, where
   there is one (see :mod:`gputq.client.host_outputs`).
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
from gputq.client.read_context import ReadContext
from gputq.client.shard_plan import FieldStage, ReadRequest, build_plan, lay_out, stage_field
from gputq.data.fields import sample_key_of
from gputq.data.refs import Layout
from gputq.data.slices import layer_major
from gputq.errors import HintMissedError, LayoutError
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
        return results, stats

    def _fetch_once(self, per_field: dict, samples: int, *, ahead: bool) -> tuple[list[dict], FetchStats]:
        stats = FetchStats(samples=samples)
        with contextlib.ExitStack() as lent:  # pooled staging goes back once restored
            started = time.perf_counter()
            requests, nbytes = lay_out([stage for _, stage in per_field.values()], self._ctx.config.max_frame_bytes)
            # zero-copy over shm, else None; the unpack kernel reads plain staging in device memory only
            device_unpack = not self._ctx.on_host and any(stage.packing for _, stage in per_field.values())
            staging = None if device_unpack else mapped_staging(self._ctx, requests, nbytes, stats, lent, ahead=ahead)
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
        read_requests(self._ctx, requests, staging)
        return staging

    def _restore(self, per_field: dict, staging, samples: int) -> list[dict]:
        results: list[dict] = [{} for _ in range(samples)]
        for name, (layouts, stage) in per_field.items():
            plan, offsets, total = build_plan(stage, layouts)
            fill = stage.fill
            restored = stage.restored
            nbytes = total * stage.width * restored.itemsize
            out = (self._outputs.take(nbytes) if self._ctx.on_host else self._ctx.buffers.empty(nbytes)).view(restored)
            rows = staging.nbytes // stage.row_bytes  # a view of whole rows from byte 0
            compact = staging[:rows * stage.row_bytes].view(stage.dtype)
            if layer_major(stage.row_shape):
                if self._ctx.on_host:
                    token_major_on_host(compact, stage, layouts, offsets, out, fill)
                else:
                    out = self._token_major(compact, plan, stage, out, fill, total)
            else:
                restore_scatter(compact, plan, stage.width, out, fill, packing=stage.packing)
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
        restore_scatter(compact, plan, inner, by_layer, fill, packing=stage.packing)
        shape = (stage.row_shape[0], total, inner)
        self._ctx.synchronize()  # torch's stream runs the transpose
        source, target = torch.from_dlpack(by_layer), torch.from_dlpack(out)
        target.view(total, shape[0], inner).copy_(source.view(shape).permute(1, 0, 2))
        if target.is_cuda and torch.cuda.is_available():  # (a CUDA stand-in's tensors copy synchronously)
            torch.cuda.current_stream(target.device).synchronize()
        return out

