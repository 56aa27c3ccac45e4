"""The numpy reference of widen+scatter: the definition of its semantics.

Every other backend must match it bit for bit. It is vectorised over rows:
the plan is expanded into row gather/scatter indices once, then one fancy
indexing assignment moves all fragments (no Python loop over rows or plan
entries).
"""

from __future__ import annotations

import numpy as np

from .plan import PlanError, check_call, row_gather_indices

__all__ = ["reference_widen_scatter"]


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
    src_idx, dst_idx, fill_idx = row_gather_indices(plan)
    out_rows = out.reshape(-1, width)  # a view: out is C-contiguous
    out_rows[dst_idx] = staging.reshape(-1, width)[src_idx]
    out_rows[fill_idx] = fill
    return out
