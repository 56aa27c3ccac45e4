"""The whole-shard restore of layer-major fields on the host: widened straight into token-major arrays.

R3 is stored layer-major (``[L, rows, K]`` a blob) so that a pipeline
stage's layers are contiguous; a whole-shard fetch hands slime its
token-major ``[rows, L, K]`` int32 tensors. :func:`token_major_on_host`
does both at once from the one read plan's pieces (see
:class:`~gputq.client.plan.FieldPlan`), reading each stored byte once
(packed IDs too: the host codec unpacks each fragment's layer runs
straight into their token-major rows).
"""

from __future__ import annotations

import sys

import numpy as np

from gputq.client.plan_fields import FieldPlan
from gputq.kernels import MappedSource
from gputq.kernels.host_native import unpack_token_major_host

__all__ = ["token_major_on_host", "host_torch"]

#: Tokens transposed at a time: every layer's run of a chunk is read while the chunk's rows stay in cache.
_TRANSPOSE_ROWS = 512


def token_major_on_host(compact, fp: FieldPlan, out: np.ndarray) -> None:
    """Widen a layer-major field's pieces straight into token-major ``out`` ``[tokens, L, ...]``.

    ``compact`` is the staging view in ``fp.stored`` (numpy) or, read in
    place, the :class:`~gputq.kernels.MappedSource` over the units' arenas:
    each fragment's layer runs are read where they lie, once (a fragment's
    runs lie in one key's bytes, one mapped segment).
    Fragment by fragment with torch's transposing copy where the process has
    torch loaded (a trainer has). Without torch, chunk by chunk of tokens: the chunk's
    layer runs are gathered token-major into a scratch chunk that stays in
    cache, a token's ``row_shape[1:]`` moved as one item (element by element
    numpy's transposing copy runs at half that speed), then widened into
    ``out`` in one contiguous cast. Packed IDs are unpacked by the host
    codec straight into their token-major rows.
    """
    layers, inner = len(fp.layers), fp.width
    target = out.reshape(-1, layers, inner)
    runs = _LayerRuns(compact, layers, fp.row_bytes // fp.stored.itemsize)
    torch = None if fp.packing is not None else host_torch(fp.stored)
    if fp.packing is None and torch is None:
        scratch = np.empty((_TRANSPOSE_ROWS, layers, inner), fp.stored)
        item = np.dtype((np.void, inner * fp.stored.itemsize))
        gathered = scratch.view(item).reshape(_TRANSPOSE_ROWS, layers)
    for first, step, dst, rows in fp.pieces.tolist():
        if first < 0:
            target[dst:dst + rows] = fp.fill
            continue
        source = runs(first, step, rows)  # [L, rows, row elements]
        if fp.packing is not None:
            unpack_token_major_host(source, *fp.packing, target[dst:dst + rows])
        elif torch is not None:
            torch.from_numpy(target[dst:dst + rows]).copy_(torch.from_numpy(source).permute(1, 0, 2))
        else:
            by_item = source.view(item).reshape(layers, rows)
            for done in range(0, rows, _TRANSPOSE_ROWS):
                n = min(_TRANSPOSE_ROWS, rows - done)
                np.copyto(gathered[:n], by_item[:, done:done + n].T)
                np.copyto(target[dst + done:dst + done + n], scratch[:n], casting="unsafe")


class _LayerRuns:
    """A fragment's runs in every layer as one strided ``[L, rows, row elements]`` view of the compact bytes."""

    def __init__(self, compact, layers: int, row_elements: int):
        self._layers, self._row = layers, row_elements
        if isinstance(compact, MappedSource):
            self._at = compact.host_array
        else:
            flat = compact.reshape(-1)
            self._at = lambda first, count: flat[first:first + count]

    def __call__(self, first: int, step: int, rows: int) -> np.ndarray:
        """Rows ``[first + l * step, first + l * step + rows)`` of the compact rows, for each layer ``l``."""
        row = self._row
        flat = self._at(first * row, ((self._layers - 1) * step + rows) * row)
        item = flat.itemsize
        # Writable as the staging is: torch wraps no read-only array without a warning; nothing writes to it.
        return np.lib.stride_tricks.as_strided(flat, (self._layers, rows, row), (step * row * item, row * item, item))


def host_torch(dtype: np.dtype):
    """torch, where this process has imported it (a trainer has) and it holds ``dtype``; else None.

    Its transposing copy moves a ``[L, T, K]`` int32 blob token-major faster
    than numpy's in-cache gather. gputq does not import
    it for that: a numpy-only process would pay the whole of torch's import.
    torch before 2.3 has no uint16 tensors.
    """
    torch = sys.modules.get("torch")
    if torch is None or (dtype == np.uint16 and not hasattr(torch, "uint16")):
        return None
    return torch
