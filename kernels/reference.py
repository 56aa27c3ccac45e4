"""The numpy reference of widen+scatter: the definition of its semantics.

Every other backend must match it bit for bit. It never loops over rows in
Python: plans of long fragments (the common case: a step's hundreds to
thousands of tokens) copy one contiguous slice per plan row; plans of
short fragments are expanded into row gather/scatter indices once and
moved by one fancy-indexing assignment.
"""

from __future__ import annotations

import numpy as np

from gputq.errors import PlanError

from .plan import check_call, row_gather_indices

__all__ = ["reference_widen_scatter"]

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
        # Long fragments: one contiguous widening copy each runs at memory speed,
        # where a row gather costs an index per row (~10x slower on 100 MB shards).
        for src, dst, rows in plan.tolist():
            out_rows[dst:dst + rows] = fill if src < 0 else staging_rows[src:src + rows]
        return out
    src_idx, dst_idx, fill_idx = row_gather_indices(plan)
    out_rows[dst_idx] = staging_rows[src_idx]
    out_rows[fill_idx] = fill
    return out
