"""Plans for the widen+scatter kernel: validation and fragment tables.

A plan is an int64 array of shape ``[n, 3]``; each row ``(src_row, dst_row,
rows)`` copies rows ``[src_row, src_row + rows)`` of the staging buffer to
rows ``[dst_row, dst_row + rows)`` of the output, widening the elements.
``src_row == -1`` writes the scalar ``fill`` into the destination rows
instead. Every backend (numpy reference, CUDA kernel, torch fallback) checks
its inputs here and derives its index arithmetic from the helpers below, so
they cannot drift apart.

This module imports numpy only; arrays of other libraries are described by
their dtype name and element count, never imported.
"""

from __future__ import annotations

import numpy as np

from gputq.errors import PlanError

__all__ = [
    "INPUT_DTYPES",
    "OUTPUT_DTYPE_FOR",
    "dtype_name",
    "as_plan_array",
    "validate_plan",
    "check_buffers",
    "check_fill",
    "check_call",
    "check_unpack_call",
    "packed_row_bytes",
    "row_gather_indices",
    "plan_bytes",
]

# Compact staging dtype -> the only output dtype it may be widened into.
OUTPUT_DTYPE_FOR = {
    "uint8": "int32",
    "uint16": "int32",
    "int32": "int32",
    "float32": "float32",
}
INPUT_DTYPES = tuple(OUTPUT_DTYPE_FOR)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def dtype_name(dtype) -> str:
    """Return the canonical name (``"uint8"``, ...) of a numpy, CuPy or torch dtype.

    Parameters
    ----------
    dtype : numpy dtype-like or torch.dtype

    Returns
    -------
    str
    """
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    return np.dtype(dtype).name


def as_plan_array(plan) -> np.ndarray:
    """Return ``plan`` as a host int64 array of shape ``[n, 3]``.

    Accepts numpy arrays, nested sequences, CPU torch tensors and CuPy
    arrays (copied to the host: the plan is small and the host builds the
    launch table from it anyway).

    Raises
    ------
    PlanError
        If the plan is not an integer array of shape ``[n, 3]``.
    """
    if hasattr(plan, "get") and type(plan).__module__.startswith("cupy"):
        plan = plan.get()
    elif type(plan).__module__.startswith("torch"):
        plan = plan.detach().cpu().numpy()
    arr = np.asarray(plan)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise PlanError(
            f"plan must have shape [n, 3] (src_row, dst_row, rows), got {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise PlanError(f"plan must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise PlanError("plan values exceed int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _row_text(plan: np.ndarray, i: int) -> str:
    s, d, r = (int(v) for v in plan[i])
    return f"plan row {i} (src_row={s}, dst_row={d}, rows={r})"


def validate_plan(plan, src_rows: int, dst_rows: int) -> np.ndarray:
    """Check a plan against the row counts of its staging and output buffers.

    Parameters
    ----------
    plan : array-like of int, shape [n, 3]
        Rows ``(src_row, dst_row, rows)``; ``src_row == -1`` means fill.
    src_rows : int
        Rows in the staging buffer.
    dst_rows : int
        Rows in the output buffer.

    Returns
    -------
    numpy.ndarray
        The plan as a contiguous int64 ``[n, 3]`` host array.

    Raises
    ------
    PlanError
        On a bad shape or dtype, negative row counts, a source below -1, a
        source or destination range out of bounds, or two destination
        ranges that overlap. The message names the offending plan row.
    """
    plan = as_plan_array(plan)
    if len(plan) == 0 or _plainly_valid(plan, src_rows, dst_rows):
        return plan
    src, dst, rows = plan[:, 0], plan[:, 1], plan[:, 2]
    checks = (
        (rows < 0, "has negative rows"),
        (src < -1, "has src_row below -1 (-1 alone means fill)"),
        (dst < 0, "has a negative dst_row"),
        ((src >= 0) & (src + rows > src_rows),
         f"reads past the staging buffer ({src_rows} rows)"),
        (dst + rows > dst_rows, f"writes past the output buffer ({dst_rows} rows)"),
    )
    for bad, what in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PlanError(f"{_row_text(plan, i)} {what}")
    live = np.flatnonzero(rows > 0)
    order = live[np.argsort(dst[live], kind="stable")]
    ends = dst[order] + rows[order]
    clash = np.flatnonzero(dst[order[1:]] < ends[:-1])
    if len(clash):
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        raise PlanError(
            f"{_row_text(plan, b)} overlaps the destination rows of {_row_text(plan, a)}"
        )
    return plan


def _plainly_valid(plan: np.ndarray, src_rows: int, dst_rows: int) -> bool:
    """A fast accept: True when ``plan`` passes every check of :func:`validate_plan`.

    Whole-column reductions and one sort, cheaper than the row checks,
    because every launch validates its plan.
    False only means "look closer": the row checks then name the row.
    """
    src, dst, rows = plan.T.copy()  # contiguous columns: reductions stream through memory
    if rows.min() <= 0 or src.min() < -1 or dst.min() < 0:
        return False  # zero-row entries are legal but take the slow path
    ends = dst + rows
    if ends.max() > dst_rows or (src + rows).max() > src_rows:
        return False  # a fill row's src + rows may exceed src_rows legally: the row checks decide
    order = np.argsort(dst, kind="stable")  # timsort: plans come mostly sorted, which it exploits
    return not (dst[order[1:]] < ends[order[:-1]]).any()


def check_buffers(
    staging_dtype: str, staging_len: int, out_dtype: str, out_len: int, width: int
) -> tuple[int, int]:
    """Check the dtype pair and lengths of staging and output buffers.

    Parameters
    ----------
    staging_dtype, out_dtype : str
        Canonical dtype names (see :func:`dtype_name`).
    staging_len, out_len : int
        Element counts of the flat buffers.
    width : int
        Elements per row, ``W >= 1``.

    Returns
    -------
    (src_rows, dst_rows) : tuple of int

    Raises
    ------
    PlanError
        On an unsupported dtype pair, a width below 1, or a buffer whose
        length is not a whole number of rows.
    """
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
        raise PlanError(f"width must be an integer >= 1, got {width!r}")
    width = int(width)
    want = OUTPUT_DTYPE_FOR.get(staging_dtype)
    if want is None:
        raise PlanError(
            f"staging dtype {staging_dtype} is not one of {', '.join(INPUT_DTYPES)}"
        )
    if out_dtype != want:
        raise PlanError(f"staging dtype {staging_dtype} widens into {want}, got out dtype {out_dtype}")
    for name, n in (("staging", staging_len), ("out", out_len)):
        if n % width:
            raise PlanError(f"{name} holds {n} elements, not a multiple of width {width}")
    return staging_len // width, out_len // width


def check_fill(fill, out_dtype: str):
    """Return ``fill`` as a numpy scalar of ``out_dtype``.

    Raises
    ------
    PlanError
        If an int32 output gets a fill that is not an integer in int32 range.
    """
    if out_dtype == "float32":
        return np.float32(fill)
    value = float(fill) if not isinstance(fill, (int, np.integer)) else int(fill)
    if value != int(value) or not _INT32_MIN <= int(value) <= _INT32_MAX:
        raise PlanError(f"fill {fill!r} is not representable as int32")
    return np.int32(int(value))


def check_call(
    staging_dtype: str, staging_len: int, out_dtype: str, out_len: int,
    plan, width: int, fill, validate: bool,
) -> tuple[np.ndarray, object]:
    """Run every check a backend needs before a widen+scatter call.

    Dtypes, lengths, width and fill are always checked (they select the
    kernel); the plan's bounds and overlaps only when ``validate`` is true.

    Returns
    -------
    plan : numpy.ndarray, int64 [n, 3]
    fill : numpy scalar of the output dtype

    Raises
    ------
    PlanError
    """
    src_rows, dst_rows = check_buffers(staging_dtype, staging_len, out_dtype, out_len, width)
    fill = check_fill(fill, out_dtype)
    plan = validate_plan(plan, src_rows, dst_rows) if validate else as_plan_array(plan)
    return plan, fill


def packed_row_bytes(topk: int, bits: int) -> int:
    """Bytes of one packed row of ``topk`` IDs at ``bits`` bits each (``unpack_scatter.cu``'s format)."""
    return (topk * bits + 7) // 8


def check_unpack_call(
    staging_dtype: str, staging_len: int, out_dtype: str, out_len: int,
    plan, topk, bits, fill, validate: bool,
) -> tuple[np.ndarray, np.int32, int]:
    """Run every check an unpack+scatter backend needs: uint8 rows in, int32 rows of ``topk`` IDs out.

    Returns
    -------
    plan : numpy.ndarray, int64 [n, 3]
    fill : numpy.int32
    row_bytes : int
        Bytes of one packed row.

    Raises
    ------
    PlanError
        On other dtypes, a ``topk`` below 1, ``bits`` outside [1, 16], a
        buffer that is not a whole number of rows, a fill outside int32, or
        (with ``validate``) a plan out of bounds or overlapping.
    """
    if staging_dtype != "uint8" or out_dtype != "int32":
        raise PlanError(f"unpack+scatter takes uint8 packed rows into int32, got {staging_dtype} and {out_dtype}")
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (topk, bits)) \
            or topk < 1 or not 1 <= bits <= 16:
        raise PlanError(f"topk must be >= 1 and bits in [1, 16], got {topk!r} and {bits!r}")
    row_bytes = packed_row_bytes(int(topk), int(bits))
    if staging_len % row_bytes or out_len % topk:
        raise PlanError(f"staging ({staging_len} bytes) and out ({out_len} IDs) must hold whole rows of "
                        f"{row_bytes} bytes and {topk} IDs")
    src_rows, dst_rows = staging_len // row_bytes, out_len // int(topk)
    plan = validate_plan(plan, src_rows, dst_rows) if validate else as_plan_array(plan)
    return plan, check_fill(fill, "int32"), row_bytes


def row_gather_indices(plan: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expand a validated plan into per-row gather/scatter indices.

    Parameters
    ----------
    plan : numpy.ndarray, int64 [n, 3]

    Returns
    -------
    src_idx, dst_idx : numpy.ndarray of int64
        ``out_rows[dst_idx] = staging_rows[src_idx]`` performs every copy row.
    fill_idx : numpy.ndarray of int64
        Destination rows that receive the fill value.
    """
    copy = plan[(plan[:, 0] >= 0) & (plan[:, 2] > 0)]
    fill = plan[(plan[:, 0] < 0) & (plan[:, 2] > 0)]
    src_idx, dst_idx = _expand(copy[:, 0], copy[:, 2]), _expand(copy[:, 1], copy[:, 2])
    return src_idx, dst_idx, _expand(fill[:, 1], fill[:, 2])


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + c)`` for every (s, c) without a Python loop."""
    total = int(counts.sum())
    # Offset of each range's first element within the concatenation.
    begins = np.cumsum(counts) - counts
    return np.repeat(starts - begins, counts) + np.arange(total, dtype=np.int64)


def plan_bytes(staging_dtype, out_dtype, plan, width: int) -> int:
    """Bytes a widen+scatter moves: staging bytes read plus output bytes written.

    Parameters
    ----------
    staging_dtype, out_dtype : numpy dtype-like or torch.dtype
    plan : array-like of int, shape [n, 3]
    width : int

    Returns
    -------
    int
        ``copy_elems * (in_size + out_size) + fill_elems * out_size``.
    """
    plan = as_plan_array(plan)
    in_size = np.dtype(dtype_name(staging_dtype)).itemsize
    out_size = np.dtype(dtype_name(out_dtype)).itemsize
    rows = np.maximum(plan[:, 2], 0)
    copy_rows = int(rows[plan[:, 0] >= 0].sum())
    fill_rows = int(rows[plan[:, 0] < 0].sum())
    return int(width) * (copy_rows * (in_size + out_size) + fill_rows * out_size)
