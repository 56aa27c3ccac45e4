"""The numpy reference of widen+scatter: the definition of its semantics.

Every other backend must match it bit for bit. It never loops over rows in
Python: plans of long fragments (the common case: a step's hundreds to
thousands of tokens) copy one strided block per run of plan rows that
repeat at constant steps (a fragment in every layer of a layer-major
output is one block, not one copy per layer); plans of short fragments are
expanded into row gather/scatter indices once and moved by one
fancy-indexing assignment.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from gputq.errors import PlanError

from .plan import check_call, check_unpack_call, packed_row_bytes, row_gather_indices

__all__ = ["reference_widen_scatter", "reference_unpack_scatter", "unpack_rows_into", "packed_words"]

#: Mean rows per plan row from which fragments are copied slice by slice.
_SLICE_MIN_ROWS = 16


def reference_widen_scatter(staging, plan, width, out, fill=0, *, validate=True):
    """Widen and scatter rows of ``staging`` into ``out`` on the host.

    Parameters
    ----------
    staging : numpy.ndarray
        Compact elements (uint8, uint16, int32 or float32), ``src_rows * width``
        of them; any shape, read in C order.
    plan : array-like of int, shape [n, 3]
        Rows ``(src_row, dst_row, rows)``; ``src_row == -1`` writes ``fill``.
    width : int
        Elements per row.
    out : numpy.ndarray
        C-contiguous int32 (integer staging) or float32 (float32 staging)
        output of ``dst_rows * width`` elements. Rows no plan row covers are
        left untouched.
    fill : int or float, optional
        Value written to the destination rows of fill plan rows.
    validate : bool, optional
        Check the plan's bounds and overlaps (dtypes are always checked).

    Returns
    -------
    numpy.ndarray
        ``out``, written in place.

    Raises
    ------
    PlanError
        On an invalid plan, dtype pair, width, fill, or a non-contiguous or
        read-only ``out``.
    """
    if not isinstance(staging, np.ndarray) or not isinstance(out, np.ndarray):
        raise PlanError("reference_widen_scatter takes numpy arrays for staging and out")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise PlanError("out must be a writable C-contiguous array")
    plan, fill = check_call(
        staging.dtype.name, staging.size, out.dtype.name, out.size, plan, width, fill, validate
    )
    out_rows = out.reshape(-1, width)  # a view: out is C-contiguous
    staging_rows = staging.reshape(-1, width)
    if len(plan) and plan[:, 2].sum() >= _SLICE_MIN_ROWS * len(plan):
        # Long fragments: widening copies of whole row ranges run at memory speed, where a row
        # gather costs an index per row. One copy per run of
        # them, not per plan row: each numpy copy lets go of the GIL and must take it back, and
        # beside a busy Python thread (a stream's fetch) taking it back costs more than the copy.
        for src, src_step, dst, dst_step, rows, count in _strided_runs(plan.tolist()):
            if count > 1 and _inside(src, src_step, dst, dst_step, rows, count, len(staging_rows), len(out_rows)):
                _block(out_rows, dst, dst_step, rows, count)[...] = (
                    fill if src < 0 else _block(staging_rows, src, src_step, rows, count))
                continue
            for k in range(count):  # numpy's slices clip a plan row outside a buffer (unvalidated plans)
                at, to = src + k * src_step, dst + k * dst_step
                out_rows[to:to + rows] = fill if src < 0 else staging_rows[at:at + rows]
        return out
    src_idx, dst_idx, fill_idx = row_gather_indices(plan)
    out_rows[dst_idx] = staging_rows[src_idx]
    out_rows[fill_idx] = fill
    return out


def _strided_runs(plan_rows: list) -> list:
    """Plan rows (a list of ``[src, dst, rows]``) as runs ``(src, src_step, dst, dst_step, rows, count)``.

    A run's ``count`` rows all copy (or all fill) ``rows`` rows, read at a
    constant step of at least zero and written at a constant step of at
    least ``rows``: its destinations never overlap, one strided block each
    side covers it.
    """
    runs, i, n = [], 0, len(plan_rows)
    while i < n:
        src, dst, rows = plan_rows[i]
        j, src_step, dst_step = i + 1, 0, 0
        if j < n:
            src_step, dst_step = plan_rows[j][0] - src, plan_rows[j][1] - dst
            if rows > 0 and dst_step >= rows and src_step >= 0:
                while j < n and plan_rows[j][2] == rows and (plan_rows[j][0] < 0) == (src < 0) \
                        and plan_rows[j][0] - plan_rows[j - 1][0] == src_step \
                        and plan_rows[j][1] - plan_rows[j - 1][1] == dst_step:
                    j += 1
        runs.append((src, src_step, dst, dst_step, rows, j - i))
        i = j
    return runs


def _inside(src: int, src_step: int, dst: int, dst_step: int, rows: int, count: int, src_rows: int,
            dst_rows: int) -> bool:
    """Whether a run lies inside both buffers, as a strided view needs (numpy's slices would clip it)."""
    last = count - 1
    return 0 <= dst and dst + last * dst_step + rows <= dst_rows and (
        src < 0 or (0 <= src and src + last * src_step + rows <= src_rows))


def _block(rows_2d: np.ndarray, first: int, step: int, rows: int, count: int) -> np.ndarray:
    """``count`` ranges of ``rows`` rows, ``step`` rows apart from row ``first``, as one strided view."""
    return as_strided(rows_2d[first:], shape=(count, rows, rows_2d.shape[1]),
                      strides=(step * rows_2d.strides[0], *rows_2d.strides))


def packed_words(topk: int, bits: int) -> int:
    """64-bit words that hold one packed row while it is assembled or taken apart: one more than its
    bits need, so that an ID's high part always has a word to go to."""
    return -(-(topk * bits) // 64) + 1


def unpack_rows_into(rows: np.ndarray, topk: int, bits: int, out: np.ndarray) -> np.ndarray:
    """Unpack uint8 ``rows`` ``[n, packed_row_bytes]`` into int32 ``out`` ``[n, topk]``.

    Each row is widened into 64-bit words, then every ID is one shift, one
    OR of its high part where it straddles two words, and one mask: numpy
    operations per column of IDs, none per row.
    """
    row_bytes = packed_row_bytes(topk, bits)
    words = np.zeros((len(rows), packed_words(topk, bits) * 8), np.uint8)
    words[:, :row_bytes] = rows
    acc = words.view("<u8")
    mask = np.uint64((1 << bits) - 1)
    for j in range(topk):
        word, shift = divmod(j * bits, 64)
        value = acc[:, word] >> np.uint64(shift)
        if shift + bits > 64:
            value |= acc[:, word + 1] << np.uint64(64 - shift)
        out[:, j] = value & mask
    return out


def reference_unpack_scatter(staging, plan, topk, bits, out, fill=0, *, validate=True):
    """Unpack and scatter rows of packed expert IDs on the host: ``unpack_scatter.cu``'s definition.

    Parameters
    ----------
    staging : numpy.ndarray of uint8
        Packed rows, ``packed_row_bytes(topk, bits)`` bytes each, read in C order.
    plan : array-like of int, shape [n, 3]
        Rows ``(src_row, dst_row, rows)``; ``src_row == -1`` writes ``fill``.
    topk, bits : int
        IDs per row and bits per ID (1..16).
    out : numpy.ndarray of int32
        C-contiguous output of ``dst_rows * topk`` IDs; rows no plan row
        covers are left untouched.
    fill : int
        ID written to the destination rows of fill plan rows.
    validate : bool
        Check the plan's bounds and overlaps.

    Raises
    ------
    PlanError
        On a bad plan, dtype, width or an output that is not writable and contiguous.
    """
    if not isinstance(staging, np.ndarray) or not isinstance(out, np.ndarray):
        raise PlanError("reference_unpack_scatter takes numpy arrays for staging and out")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise PlanError("out must be a writable C-contiguous array")
    plan, fill, row_bytes = check_unpack_call(staging.dtype.name, staging.size, out.dtype.name, out.size, plan,
                                              topk, bits, fill, validate)
    src_rows, out_rows = staging.reshape(-1, row_bytes), out.reshape(-1, topk)
    src_idx, dst_idx, fill_idx = row_gather_indices(plan)
    out_rows[dst_idx] = unpack_rows_into(src_rows[src_idx], topk, bits, np.empty((len(src_idx), topk), np.int32))
    out_rows[fill_idx] = fill
    return out
