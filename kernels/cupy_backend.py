"""CUDA widen+scatter through CuPy: host side of ``widen_scatter.cu``.

One call is one kernel launch: the plan becomes a small fragment table
(see the header of ``widen_scatter.cu``), uploaded with one host-to-device
copy on the launch stream, and one grid covers every fragment. The module
is compiled with NVRTC once per (device, chunk size) and cached.

CuPy arrays are used directly; CUDA torch tensors are launched on by raw
pointer, on torch's current stream unless a stream is given, so the call
orders with the caller's torch work.
"""

from __future__ import annotations

import functools
import threading
import warnings
from pathlib import Path

import numpy as np

from .plan import PlanError, check_call, dtype_name

__all__ = [
    "DEFAULT_CHUNK",
    "THREADS",
    "cupy_usable",
    "fragment_table",
    "cupy_widen_scatter",
    "torch_widen_scatter_cupy",
]

# Elements of one fragment a block handles, and threads per block; each
# thread moves DEFAULT_CHUNK / (4 * THREADS) 16-byte vectors per chunk.
DEFAULT_CHUNK = 4096
THREADS = 256

_SOURCE = Path(__file__).with_name("widen_scatter.cu")
_KERNELS = {
    "uint8": "widen_scatter_u8_i32",
    "uint16": "widen_scatter_u16_i32",
    "int32": "widen_scatter_i32_i32",
    "float32": "widen_scatter_f32_f32",
}
_INT32_MAX = 2**31 - 1
_modules: dict = {}
_modules_lock = threading.Lock()


def _import_cupy():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
    except ImportError as exc:
        raise ImportError(
            "the CUDA widen+scatter kernel needs CuPy: pip install cupy-cuda12x "
            "(or cupy-cuda13x to match your CUDA)"
        ) from exc
    return cupy


def cupy_usable() -> bool:
    """Return True when CuPy imports and sees a CUDA device (:mod:`transport.cuda`'s probe)."""
    return usable_cupy() is not None


def fragment_table(
    plan: np.ndarray, width: int, src_ptr: int, src_itemsize: int, dst_ptr: int,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[np.ndarray, int, int]:
    """Build the kernel's fragment table from a validated plan.

    Parameters
    ----------
    plan : numpy.ndarray, int64 [n, 3]
    width : int
    src_ptr, dst_ptr : int
        Device addresses of the staging and (4-byte element) output buffers;
        the table's alignment bits depend on them.
    src_itemsize : int
        Bytes per staging element.
    chunk : int
        Elements per block; a multiple of ``4 * THREADS``.

    Returns
    -------
    table : numpy.ndarray of int64
        ``4 * nfrag`` fragment entries then ``nfrag`` first-block indices.
    nfrag : int
        Fragments (plan rows with ``rows > 0``).
    nblocks : int
        Grid size.
    """
    live = plan[plan[:, 2] > 0]
    is_fill = live[:, 0] < 0
    n = live[:, 2] * width
    src = np.where(is_fill, 0, live[:, 0] * width)
    dst = live[:, 1] * width
    # Elements before the first 16-byte-aligned destination element.
    head = np.minimum(n, (-(dst_ptr // 4 + dst)) % 4)
    vec_bytes = 4 * src_itemsize
    src_aligned = ~is_fill & ((src_ptr + (src + head) * src_itemsize) % vec_bytes == 0)
    blocks = np.maximum(1, -(-(n - head) // chunk))
    first_block = np.cumsum(blocks) - blocks
    meta = head | (is_fill.astype(np.int64) << 2) | (src_aligned.astype(np.int64) << 3)
    table = np.concatenate([np.stack([src, dst, n, meta], axis=1).ravel(), first_block])
    return np.ascontiguousarray(table, dtype=np.int64), len(live), int(blocks.sum())


def _module(cp, device_id: int, chunk: int):
    key = (device_id, chunk)
    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            with cp.cuda.Device(device_id):
                mod = cp.RawModule(
                    code=_SOURCE.read_text(),
                    options=("-std=c++17", f"-DWS_CHUNK={chunk}", f"-DWS_THREADS={THREADS}"),
                )
                # Compile and load now, on this device, not at first launch.
                for name in _KERNELS.values():
                    mod.get_function(name)
            _modules[key] = mod
    return mod


def _cupy_stream(cp, stream, torch_device=None):
    """Return a CuPy stream object for ``stream``, or None for CuPy's current one."""
    if stream is None:
        if torch_device is None:
            return None
        import torch

        return cp.cuda.ExternalStream(torch.cuda.current_stream(torch_device).cuda_stream)
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return cp.cuda.ExternalStream(stream.cuda_stream)
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream or ExternalStream
        return stream
    if isinstance(stream, (int, np.integer)):
        return cp.cuda.ExternalStream(int(stream))
    raise PlanError(f"unsupported stream {stream!r}: pass a CuPy or torch stream or a handle")


def _launch(cp, src_ptr, in_dtype, dst_ptr, plan, width, fill, device_id, stream, chunk):
    if src_ptr % np.dtype(in_dtype).itemsize or dst_ptr % 4:
        raise PlanError("staging and out must be aligned to their element size")
    table, nfrag, nblocks = fragment_table(
        plan, width, src_ptr, np.dtype(in_dtype).itemsize, dst_ptr, chunk
    )
    if nfrag == 0:
        return
    if nblocks > _INT32_MAX or nfrag > _INT32_MAX:
        raise PlanError(f"plan needs {nblocks} blocks, more than one grid holds")
    module = _module(cp, device_id, chunk)
    with cp.cuda.Device(device_id):
        kernel = module.get_function(_KERNELS[in_dtype])
        with stream if stream is not None else cp.cuda.get_current_stream():
            table_dev = cp.asarray(table)
            kernel(
                (nblocks,), (THREADS,),
                (np.uint64(src_ptr), np.uint64(dst_ptr), table_dev, np.int32(nfrag), fill),
            )
            # table_dev returns to CuPy's pool for this stream: a later
            # allocation reusing it is ordered after the kernel.


def cupy_widen_scatter(staging, plan, width, out, fill=0, *, validate=True, stream=None,
                       chunk=DEFAULT_CHUNK):
    """Widen+scatter CuPy arrays with the CUDA kernel (one launch).

    Parameters and semantics as :func:`kernels.widen_scatter`; ``stream`` is
    a CuPy stream, a torch stream or a raw handle (default: CuPy's current
    stream). ``chunk`` tunes elements per block (benchmarks only).

    Returns
    -------
    cupy.ndarray
        ``out``.
    """
    cp = _import_cupy()
    if not isinstance(staging, cp.ndarray) or not isinstance(out, cp.ndarray):
        raise PlanError("cupy_widen_scatter takes CuPy arrays for staging and out")
    if staging.device.id != out.device.id:
        raise PlanError(f"staging is on device {staging.device.id}, out on {out.device.id}")
    if not out.flags.c_contiguous:
        raise PlanError("out must be C-contiguous")
    plan, fill = check_call(
        staging.dtype.name, staging.size, out.dtype.name, out.size, plan, width, fill, validate
    )
    if not staging.flags.c_contiguous:
        raise PlanError("staging must be C-contiguous")
    cs = _cupy_stream(cp, stream)
    _launch(cp, staging.data.ptr, staging.dtype.name, out.data.ptr, plan, int(width), fill,
            out.device.id, cs, chunk)
    return out


def torch_widen_scatter_cupy(staging, plan, width, out, fill=0, *, validate=True,
                             stream=None, chunk=DEFAULT_CHUNK):
    """Widen+scatter CUDA torch tensors with the CuPy-loaded CUDA kernel.

    Runs on torch's current stream of ``out``'s device unless ``stream`` is
    given. Parameters and semantics as :func:`kernels.widen_scatter`.

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    cp = _import_cupy()
    if not (staging.is_cuda and out.is_cuda) or staging.device != out.device:
        raise PlanError(f"staging ({staging.device}) and out ({out.device}) must share one CUDA device")
    if not out.is_contiguous() or not staging.is_contiguous():
        raise PlanError("staging and out must be contiguous")
    in_dtype = dtype_name(staging.dtype)
    plan, fill = check_call(
        in_dtype, staging.numel(), dtype_name(out.dtype), out.numel(), plan, width, fill, validate
    )
    cs = _cupy_stream(cp, stream, torch_device=out.device)
    _launch(cp, staging.data_ptr(), in_dtype, out.data_ptr(), plan, int(width), fill,
            out.device.index, cs, chunk)
    return out
