"""Widen+scatter: restore compact per-token fields into int32/float32 tensors.

``widen_scatter(staging, plan, width, out, fill)`` copies row ranges of a
compact staging buffer (uint8/uint16/int32 IDs or float32 values) into an
int32 (or float32) output, widening each element, and writes ``fill`` into
the rows of fill plan rows. It dispatches on the array type:

- numpy arrays: the host codec (``host_widen.c``, the whole plan in one
  call; built on first use), else the vectorised numpy reference (the
  semantics);
- CuPy arrays: the CUDA kernel, one launch per call;
- CUDA torch tensors: the CUDA kernel through CuPy when CuPy has a working
  device, else the torch fallback; CPU torch tensors: the torch fallback;
- a :class:`MappedSource` (compact bytes left in mapped host memory) with a
  CUDA ``out``: the CUDA kernel reading them in place (zero-copy); with a
  numpy ``out``, the host codec reading them in place (packed IDs too,
  through :func:`unpack_scatter`).

Nothing here knows about RL, and only numpy is needed to import it. A bad
plan or buffer raises :class:`gputq.errors.PlanError` (an ``InvalidInputError``,
so a ``ValueError`` too).
"""

from __future__ import annotations

import numpy as np

from gputq.errors import PlanError
from gputq.transport.cuda import cuda_available

from .cupy_backend import (cupy_unpack_scatter, cupy_usable, cupy_widen_scatter, torch_unpack_scatter_cupy,
                           torch_widen_scatter_cupy)
from .host_native import unpack_scatter_host, widen_scatter_host
from .mapped import MappedSource
from .plan import plan_bytes, validate_plan
from .reference import reference_unpack_scatter, reference_widen_scatter
from .torch_backend import torch_widen_scatter

__all__ = [
    "widen_scatter",
    "unpack_scatter",
    "restore_scatter",
    "reference_widen_scatter",
    "reference_unpack_scatter",
    "cupy_unpack_scatter",
    "validate_plan",
    "plan_bytes",
    "cuda_available",
    "MappedSource",
]


def _array_kind(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    return type(x).__module__.split(".", 1)[0]


def widen_scatter(staging, plan, width, out, fill=0, *, validate=True, stream=None):
    """Widen rows of ``staging`` and scatter them into ``out``, in place.

    Parameters
    ----------
    staging : numpy.ndarray, cupy.ndarray or torch.Tensor
        ``src_rows * width`` compact elements (uint8, uint16, int32 or
        float32), read in C order.
    plan : array-like of int, shape [n, 3]
        Rows ``(src_row, dst_row, rows)``: staging rows ``[src_row, src_row
        + rows)`` go to out rows ``[dst_row, dst_row + rows)``;
        ``src_row == -1`` writes ``fill`` there instead. Destination ranges
        must not overlap; source ranges may.
    width : int
        Elements per row (``L * K`` for expert IDs, 1 for logprobs).
    out : same array type as ``staging``
        Contiguous int32 (integer staging) or float32 (float32 staging)
        buffer of ``dst_rows * width`` elements. Rows no plan row covers are
        left untouched.
    fill : int or float, optional
        Value for fill rows; must fit int32 for int32 output.
    validate : bool, optional
        Check the plan's bounds and overlaps (dtypes, lengths and fill are
        always checked). Skip only for plans built by trusted code.
    stream : optional
        CUDA stream for GPU arrays (CuPy or torch stream, or a raw handle);
        default: CuPy's current stream for CuPy arrays, torch's current
        stream for torch tensors. Ignored for host arrays.

    Returns
    -------
    The ``out`` object.

    Raises
    ------
    PlanError
        On an invalid plan or buffers, or ``staging`` and ``out`` of
        different array types.
    """
    if isinstance(staging, MappedSource):  # zero-copy: compact bytes left in mapped host memory
        return staging.widen_scatter(plan, width, out, fill, validate=validate, stream=stream)
    kind = _array_kind(staging)
    if kind != _array_kind(out):
        raise PlanError(
            f"staging ({type(staging).__name__}) and out ({type(out).__name__}) "
            "must be the same array type"
        )
    if kind == "numpy":
        return widen_scatter_host(staging, plan, width, out, fill, validate=validate)
    if kind == "cupy":
        return cupy_widen_scatter(staging, plan, width, out, fill, validate=validate, stream=stream)
    if kind == "torch":
        if out.is_cuda and cupy_usable():
            return torch_widen_scatter_cupy(
                staging, plan, width, out, fill, validate=validate, stream=stream
            )
        return torch_widen_scatter(staging, plan, width, out, fill, validate=validate, stream=stream)
    raise PlanError(f"unsupported array type {type(staging).__name__}")




def unpack_scatter(staging, plan, topk, bits, out, fill=0, *, validate=True, stream=None):
    """Unpack rows of packed expert IDs from ``staging`` and scatter them into ``out``, in place.

    The packed counterpart of :func:`widen_scatter`: ``staging`` holds uint8
    rows of ``packed_row_bytes(topk, bits)`` bytes (see
    :mod:`gputq.data.packing`), ``out`` int32 rows of ``topk`` IDs, and
    ``plan`` counts in rows. Dispatch: numpy arrays, CPU torch tensors and
    a :class:`MappedSource` of host addresses into a numpy ``out`` (each row
    read where it lies) run the host codec (``host_codec.c``, built on first
    use; the numpy reference where it cannot be), CuPy arrays and CUDA torch tensors the CUDA
    kernel (CUDA torch tensors through CuPy, on torch's current stream
    unless ``stream`` is given). ``stream`` as for :func:`widen_scatter`.

    Raises
    ------
    PlanError
        On an invalid plan or buffers, arrays of different types, or CUDA
        tensors where CuPy cannot run (the kernel needs it: install
        ``cupy-cuda12x``).
    """
    if isinstance(staging, MappedSource):  # packed rows left in mapped host memory, unpacked where they lie
        return staging.unpack_scatter(plan, topk, bits, out, fill, validate=validate)
    kind = _array_kind(staging)
    if kind != _array_kind(out):
        raise PlanError(f"staging ({type(staging).__name__}) and out ({type(out).__name__}) "
                        "must be the same array type")
    if kind == "numpy":
        return unpack_scatter_host(staging, plan, topk, bits, out, fill, validate=validate)
    if kind == "cupy":
        return cupy_unpack_scatter(staging, plan, topk, bits, out, fill, validate=validate, stream=stream)
    if kind == "torch":
        if not out.is_cuda:
            unpack_scatter_host(staging.numpy(), plan, topk, bits, out.numpy(), fill, validate=validate)
            return out
        if not cupy_usable():
            raise PlanError("unpacking packed expert IDs into CUDA tensors runs a CuPy kernel: install "
                            "cupy-cuda12x (or store IDs as uint8/uint16)")
        return torch_unpack_scatter_cupy(staging, plan, topk, bits, out, fill, validate=validate, stream=stream)
    raise PlanError(f"unsupported array type {type(staging).__name__}")


def restore_scatter(staging, plan, width, out, fill=0, *, packing=None, validate=True, stream=None):
    """:func:`widen_scatter` of rows of ``width`` elements, or with ``packing`` ``(K, bits)``
    :func:`unpack_scatter` of packed rows of K IDs (``width`` is then K): what a stored field's restore runs."""
    if packing is None:
        return widen_scatter(staging, plan, width, out, fill, validate=validate, stream=stream)
    return unpack_scatter(staging, plan, *packing, out, fill, validate=validate, stream=stream)
