"""The whole-shard restore of layer-major fields on the host: widened straight into token-major arrays.

R3 is stored layer-major (``[L, rows, K]`` a blob) so that a pipeline
stage's layers are contiguous; a whole-shard fetch hands slime its
token-major ``[rows, L, K]`` int32 tensors. :func:`token_major_on_host`
does both at once, reading each blob once (packed IDs too: the host codec
unpacks each fragment's layer runs straight into their token-major rows).
"""

from __future__ import annotations

import sys

import numpy as np

from gputq.client.shard_plan import FieldStage
from gputq.kernels import MappedSource
from gputq.kernels.host_native import unpack_token_major_host

__all__ = ["token_major_on_host", "host_torch"]

#: Tokens transposed at a time: every layer's run of a chunk is read while the chunk's rows stay in cache.
_TRANSPOSE_ROWS = 512


def token_major_on_host(compact, stage: FieldStage, layouts, offsets, out: np.ndarray, fill) -> None:
    """Widen a layer-major field's blobs straight into token-major ``out`` ``[total, L, ...]``.

    ``compact`` is the staging view (numpy) or, read in place, the
    :class:`~gputq.kernels.MappedSource` over the units' arenas: each blob is
    read where it lies, once.
    Fragment by fragment with torch's transposing copy where the process has
    torch loaded (a trainer has). Without torch, chunk by chunk of tokens: the chunk's
    layer runs are gathered token-major into a scratch chunk that stays in
    cache, a token's ``row_shape[1:]`` moved as one item (element by element
    numpy's transposing copy runs at half that speed), then widened into
    ``out`` in one contiguous cast.
    """
    layers = stage.row_shape[0]
    inner = stage.width // layers
    item = np.dtype((np.void, inner * stage.dtype.itemsize))
    if isinstance(compact, MappedSource):
        blob_at = compact.host_array
    else:
        flat = compact.reshape(-1)

        def blob_at(first: int, count: int) -> np.ndarray:
            return flat[first:first + count]
    target = out.reshape(-1, layers, inner)
    if stage.packing is not None:
        return _unpack_token_major(blob_at, stage, layouts, offsets, target, fill)
    torch = host_torch(stage.dtype)
    if torch is None:
        scratch = np.empty((_TRANSPOSE_ROWS, layers, inner), stage.dtype)
        gathered = scratch.view(item).reshape(_TRANSPOSE_ROWS, layers)
    for layout, first in zip(layouts, offsets):
        cursor = 0
        for frag in layout.fragments:  # sorted by target row
            if frag.dst_row > cursor:
                target[first + cursor:first + frag.dst_row] = fill
            blob = blob_at(stage.ref_row[(frag.ref.unit, frag.ref.key)] * stage.width, layers * frag.ref.rows * inner)
            dst = first + frag.dst_row
            if torch is not None:
                source = blob.reshape(layers, frag.ref.rows, inner)[:, frag.src_row:frag.src_row + frag.rows]
                torch.from_numpy(target[dst:dst + frag.rows]).copy_(torch.from_numpy(source).permute(1, 0, 2))
            else:
                by_item = blob.view(item).reshape(layers, frag.ref.rows)
                for done in range(0, frag.rows, _TRANSPOSE_ROWS):
                    n = min(_TRANSPOSE_ROWS, frag.rows - done)
                    src = frag.src_row + done
                    np.copyto(gathered[:n], by_item[:, src:src + n].T)
                    np.copyto(target[dst + done:dst + done + n], scratch[:n], casting="unsafe")
            cursor = frag.dst_row + frag.rows
        if cursor < layout.rows:
            target[first + cursor:first + layout.rows] = fill


def _unpack_token_major(blob_at, stage: FieldStage, layouts, offsets, target: np.ndarray, fill) -> None:
    """:func:`token_major_on_host` of packed IDs: each fragment's layer runs unpacked straight into their
    token-major rows of ``target`` ``[total, L, K]``."""
    layers, (topk, bits) = target.shape[1], stage.packing
    row_bytes = stage.row_bytes // layers
    for layout, first in zip(layouts, offsets):
        cursor = 0
        for frag in layout.fragments:  # sorted by target row
            if frag.dst_row > cursor:
                target[first + cursor:first + frag.dst_row] = fill
            blob = blob_at(stage.ref_row[(frag.ref.unit, frag.ref.key)] * stage.row_bytes,
                           layers * frag.ref.rows * row_bytes).reshape(layers, frag.ref.rows, row_bytes)
            dst = first + frag.dst_row
            unpack_token_major_host(blob, frag.src_row, frag.rows, topk, bits, target[dst:dst + frag.rows])
            cursor = frag.dst_row + frag.rows
        if cursor < layout.rows:
            target[first + cursor:first + layout.rows] = fill


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
