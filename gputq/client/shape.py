"""The restore and shape stages of a streamed micro-batch: widened to int32, then laid out as slime's.

:meth:`SlimeShaper.widen` runs each field's widen-and-scatter from its
compact bytes (a staging buffer, or the mapped arenas read in place) into
the micro-batch's output buffers; :meth:`SlimeShaper.shape` writes slime's
pad rows (``arange % num_experts``, see :func:`~gputq.data.slices.pad_block`),
refuses a layer whose routes are all zero as slime does, and cuts the
views the consumer gets: one ``[tokens, topk]`` array per layer for
Megatron's router replay, and the CP-cut ``rollout_log_probs`` per sample.
"""

from __future__ import annotations

import numpy as np

from gputq.client.read_context import ReadContext
from gputq.client.plan import MicroPlan
from gputq.client.plan_fields import FieldPlan
from gputq.client.widen_shares import WidenShares
from gputq.data.fields import sample_key_of
from gputq.data.slices import ParallelSlice, pad_block
from gputq.errors import LayoutError
from gputq.kernels import restore_scatter

__all__ = ["SlimeShaper"]

#: Rows of each stored piece the empty-layer check looks at before it scans a layer whole.
_FIRST_ROWS = 64


class SlimeShaper:
    """Widens one rank's micro-batches and shapes them as slime hands them to Megatron.

    Parameters
    ----------
    context:
        The reader's context: the device and its output conversion.
    rank:
        The rank's slice: its ``num_experts`` numbers the pad rows.
    shares:
        How a large micro-batch is widened on the host: in shares on several
        threads (see :mod:`gputq.client.widen_shares`); None, whole on the calling thread.
    """

    def __init__(self, context: ReadContext, rank: ParallelSlice, shares: WidenShares | None = None):
        self._ctx, self._rank = context, rank
        self._shares = shares if shares is not None and context.on_host else WidenShares(1)
        self._pad_blocks: dict[tuple, np.ndarray] = {}

    def widen(self, plan: MicroPlan, staging, outputs: dict) -> dict:
        """Widen every field of ``plan`` from ``staging`` into ``outputs`` (returned); device work waited for."""
        for name, fp in plan.fields.items():
            out = outputs[name][:fp.out_elements]
            rows = staging.nbytes // fp.row_bytes
            compact = staging[:rows * fp.row_bytes].view(fp.stored)
            # Each share restored before the next field's: the widen returns once all are done.
            self._shares(lambda share: restore_scatter(compact, share, fp.width, out, fp.fill, packing=fp.packing,
                                                       validate=False), fp.plan, fp.width * fp.restored.itemsize)
        if not self._ctx.on_host:
            # The kernels ran on CuPy's stream; the pad rows and the check after go through torch's.
            self._ctx.synchronize()
        return outputs

    def shape(self, plan: MicroPlan, outputs: dict) -> tuple[tuple, list, dict]:
        """Widened ``outputs`` as slime's micro-batch: its layers, one ``[tokens, topk]`` view per layer, and
        per sample-key name the layer-major array or the per-sample arrays; pad rows written, empty
        layers refused (``LayoutError`` naming the micro-batch and layer)."""
        fields, experts, layers = {}, [], ()
        to_output = self._ctx.to_output
        for name, fp in plan.fields.items():
            out = outputs[name][:fp.out_elements]
            if fp.layers:
                shaped = out.reshape(len(fp.layers), fp.tokens, fp.width)
                self._pad(fp, shaped)
                self._check_layers(fp, shaped, plan)
                fields[name] = to_output(shaped)
                experts, layers = [to_output(shaped[j]) for j in range(len(fp.layers))], fp.layers
            else:
                fields[name] = [to_output(out[a * fp.width:(a + n) * fp.width]) for a, n in fp.sample_rows]
        return layers, experts, {sample_key_of(n): v for n, v in fields.items()}

    def _pad(self, fp: FieldPlan, shaped) -> None:
        for offset, start, stop in fp.pads:
            # The same few blocks in every micro-batch of the rank (a sample's pad row is its last):
            # built once, not on the fetch thread each time.
            shape = (start, stop, fp.layers, fp.stored_layers, fp.width)
            block = self._pad_blocks.get(shape)
            if block is None:
                block = self._pad_blocks[shape] = pad_block(*shape, self._rank.num_experts)
            if self._ctx.on_host:
                shaped[:, offset:offset + stop - start] = block
            else:
                import torch

                torch.from_dlpack(shaped[:, offset:offset + stop - start]).copy_(torch.from_numpy(block))

    def _check_layers(self, fp: FieldPlan, shaped, plan: MicroPlan) -> None:
        """slime refuses to replay a MoE layer whose captured routes are all zero (top-k > 1)."""
        if fp.width < 2 or not fp.data:
            return
        on_host = self._ctx.on_host

        def nonzero(j: int, look: int | None) -> bool:
            parts = (shaped[j, offset:offset + (rows if look is None else min(rows, look))] for offset, rows in fp.data)
            return any(bool(part.any() if on_host else self._ctx.to_output(part).any()) for part in parts)

        # Real routes are nonzero within a few tokens (top-k IDs are distinct): look at a few first,
        # and scan whole only the layers that start with zeros. On the host the first look takes
        # every layer at once in one call, over the first stored chunk: a numpy call per layer and
        # chunk would each wait for the GIL while the fetch thread runs Python.
        if on_host:
            offset, rows = fp.data[0]
            seen = shaped[:, offset:offset + min(rows, _FIRST_ROWS)].any(axis=(1, 2))
            empty = [j for j in np.flatnonzero(~seen).tolist() if not nonzero(j, None)]
        else:
            empty = [j for j in range(len(fp.layers)) if not nonzero(j, _FIRST_ROWS) and not nonzero(j, None)]
        if empty:
            raise LayoutError(f"micro-batch {plan.index} (samples {list(plan.samples)}): R3 of layer "
                              f"{fp.layers[empty[0]]} is all zero for every stored token; refusing to replay "
                              f"expert 0 everywhere")
