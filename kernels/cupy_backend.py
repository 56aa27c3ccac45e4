"""CUDA widen+scatter through CuPy: host side of ``widen_scatter.cu``.

One call is one kernel launch: the plan becomes a small fragment table
(see the header of ``widen_scatter.cu``) built with a handful of numpy
operations straight into page-locked host memory, copied asynchronously
into a device buffer that is reused from launch to launch, and one grid
covers every fragment. Nothing is allocated per launch: a few table slots
per device rotate, and a slot is refilled only after the kernel that last
read it finished (one CUDA event per slot). The module is compiled with
NVRTC once per (device, steps) and cached.

CuPy arrays are used directly; CUDA torch tensors are launched on by raw
pointer, on torch's current stream unless a stream is given, so the call
orders with the caller's torch work. :func:`widen_scatter_from_pointer`
reads the compact source from any device-accessible address, e.g. host
memory registered as mapped (zero-copy).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np

from gputq.errors import PlanError
from gputq.transport.cuda import usable_cupy

from .plan import check_call, check_unpack_call, dtype_name

__all__ = [
    "DEFAULT_STEPS",
    "THREADS",
    "TABLE_SLOTS",
    "cupy_usable",
    "chunk_elements",
    "compile_options",
    "fragment_table",
    "cupy_widen_scatter",
    "torch_widen_scatter_cupy",
    "cupy_unpack_scatter",
    "torch_unpack_scatter_cupy",
    "unpack_compile_options",
    "UNPACK_SOURCE",
    "UNPACK_KERNEL",
    "widen_scatter_from_pointer",
]

#: 16-byte groups each thread moves per block, and threads per block: a
#: block reads 16 * DEFAULT_STEPS * THREADS source bytes, whatever the dtype.
DEFAULT_STEPS = 4
THREADS = 256
#: Fragment tables in flight per device before a launch waits for an old one.
TABLE_SLOTS = 4

_SOURCE = Path(__file__).with_name("widen_scatter.cu")
#: The packed expert-ID kernel: one thread per row (``unpack_scatter.cu``).
UNPACK_SOURCE = Path(__file__).with_name("unpack_scatter.cu")
UNPACK_KERNEL = "unpack_scatter_i32"
_KERNELS = {
    "uint8": "widen_scatter_u8_i32",
    "uint16": "widen_scatter_u16_i32",
    "int32": "widen_scatter_i32_i32",
    "float32": "widen_scatter_f32_f32",
}
_INT32_MAX = 2**31 - 1
_modules: dict = {}
_modules_lock = threading.Lock()
_rings: dict = {}
_rings_lock = threading.Lock()


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
    """Return True when CuPy imports and sees a CUDA device (:mod:`gputq.transport.cuda`'s probe)."""
    return usable_cupy() is not None


def chunk_elements(itemsize: int, steps: int = DEFAULT_STEPS) -> int:
    """Source elements one block moves: ``steps`` 16-byte groups per thread."""
    return steps * THREADS * (16 // itemsize)


def fragment_table(plan: np.ndarray, width: int, chunk: int, out: np.ndarray | None = None
                   ) -> tuple[np.ndarray, int]:
    """Build the kernel's fragment table from a validated plan.

    Parameters
    ----------
    plan : numpy.ndarray, int64 [n, 3]
        Row plan (``src_row`` -1 for fill rows).
    width : int
        Elements per row: the table counts elements.
    chunk : int
        Elements per block (:func:`chunk_elements`).
    out : numpy.ndarray of int64, optional
        Where to build the table (at least ``4 * n`` entries), e.g. a
        page-locked upload buffer; default a new array.

    Returns
    -------
    table : numpy.ndarray of int64
        ``3 * n`` entries (source element or negative for fill, destination
        element, elements) then ``n`` first-block indices.
    nblocks : int
        Grid size. A fragment gets ``ceil(elements / chunk)`` blocks; an
        empty one none (it shares its first block with the next fragment,
        and the kernel's search picks the later one).
    """
    n = len(plan)
    table = np.empty(4 * n, np.int64) if out is None else out[:4 * n]
    if n == 0:
        return table, 0
    elems = table[:3 * n].reshape(n, 3)
    np.multiply(plan, width, out=elems)  # a fill row's -1 stays negative
    first = table[3 * n:]
    blocks = elems[:, 2] + (chunk - 1)
    blocks //= chunk
    np.cumsum(blocks, out=blocks)
    nblocks = int(blocks[-1])
    first[0] = 0
    first[1:] = blocks[:-1]
    return table, nblocks


def compile_options(steps: int = DEFAULT_STEPS) -> tuple[str, ...]:
    """NVRTC options the kernel module is built with (WS_STEPS groups per thread)."""
    return ("-std=c++17", f"-DWS_STEPS={steps}", f"-DWS_THREADS={THREADS}")


def unpack_compile_options() -> tuple[str, ...]:
    """NVRTC options the unpack module is built with (``UP_THREADS`` rows per block)."""
    return ("-std=c++17", f"-DUP_THREADS={THREADS}")


def _module(cp, device_id: int, steps: int | None):
    """The widen module for ``steps`` groups per thread, or (``None``) the unpack module, built on first use."""
    key = (device_id, steps)
    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            source, options, names = ((_SOURCE, compile_options(steps), _KERNELS.values()) if steps is not None
                                      else (UNPACK_SOURCE, unpack_compile_options(), (UNPACK_KERNEL,)))
            with cp.cuda.Device(device_id):
                mod = cp.RawModule(code=source.read_text(), options=options)
                # Compile and load now, on this device, not at first launch.
                for name in names:
                    mod.get_function(name)
            _modules[key] = mod
    return mod


class _TableRing:
    """Page-locked host and device buffers for fragment tables, reused across launches.

    A launch takes the next slot, waits for the kernel that last read it
    (long finished unless launches outrun the GPU by :data:`TABLE_SLOTS`),
    builds the table in its host buffer, copies it on the launch stream and
    records the slot's event after the kernel. The whole sequence holds the
    ring's lock, so no thread refills a host buffer a queued copy still reads.
    """

    def __init__(self, cp):
        self._cp = cp
        self._lock = threading.Lock()
        self._slots: list = [None] * TABLE_SLOTS  # (pinned memory, host int64 view, device array, event)
        self._next = 0

    def launch(self, plan: np.ndarray, width: int, chunk: int, stream, kernel, args) -> None:
        """Upload ``plan``'s table and launch ``kernel(grid, block, (*args[:2], table, nfrag, *args[2:]))``."""
        cp = self._cp
        entries = 4 * len(plan)
        with self._lock:
            index = self._next
            self._next = (index + 1) % TABLE_SLOTS
            slot = self._slots[index]
            if slot is not None:
                slot[3].synchronize()
            if slot is None or slot[1].size < entries:
                size = max(entries, 4096, 2 * (slot[1].size if slot is not None else 0))
                pinned = cp.cuda.alloc_pinned_memory(size * 8)
                event = slot[3] if slot is not None else cp.cuda.Event(block=False, disable_timing=True)
                slot = (pinned, np.frombuffer(pinned, np.int64, size), cp.empty(size, cp.int64), event)
                self._slots[index] = slot
            table, nblocks = fragment_table(plan, width, chunk, out=slot[1])
            if nblocks == 0:
                return
            if nblocks > _INT32_MAX:
                raise PlanError(f"plan needs {nblocks} blocks, more than one grid holds")
            cp.cuda.runtime.memcpyAsync(slot[2].data.ptr, slot[1].ctypes.data, table.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            kernel((nblocks,), (THREADS,), (*args[:2], slot[2], np.int32(len(plan)), *args[2:]), stream=stream)
            slot[3].record(stream)


def _ring(cp, device_id: int) -> _TableRing:
    with _rings_lock:
        ring = _rings.get(device_id)
        if ring is None:
            ring = _rings[device_id] = _TableRing(cp)
        return ring


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


def _launch(cp, src_ptr, in_dtype, dst_ptr, plan, width, fill, device_id, stream, steps):
    itemsize = np.dtype(in_dtype).itemsize
    if src_ptr % itemsize or dst_ptr % 4:
        raise PlanError("staging and out must be aligned to their element size")
    if len(plan) > _INT32_MAX:
        raise PlanError(f"plan has {len(plan)} rows, more than one launch holds")
    kernel = _module(cp, device_id, steps).get_function(_KERNELS[in_dtype])
    with cp.cuda.Device(device_id):
        stream = stream if stream is not None else cp.cuda.get_current_stream()
        _ring(cp, device_id).launch(plan, width, chunk_elements(itemsize, steps), stream, kernel,
                                    (np.uint64(src_ptr), np.uint64(dst_ptr), fill))


def cupy_widen_scatter(staging, plan, width, out, fill=0, *, validate=True, stream=None,
                       steps=DEFAULT_STEPS):
    """Widen+scatter CuPy arrays with the CUDA kernel (one launch).

    Parameters and semantics as :func:`kernels.widen_scatter`; ``stream`` is
    a CuPy stream, a torch stream or a raw handle (default: CuPy's current
    stream). ``steps`` tunes the 16-byte groups per thread (benchmarks only).

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
            out.device.id, cs, steps)
    return out


def torch_widen_scatter_cupy(staging, plan, width, out, fill=0, *, validate=True,
                             stream=None, steps=DEFAULT_STEPS):
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
            out.device.index, cs, steps)
    return out


def cupy_unpack_scatter(staging, plan, topk: int, bits: int, out, fill=0, *, validate=True, stream=None):
    """Unpack+scatter packed expert-ID rows of a CuPy uint8 array into CuPy int32 ``out`` (one launch).

    Semantics as :func:`~gputq.kernels.reference.reference_unpack_scatter`,
    its numpy reference; ``stream`` as :func:`cupy_widen_scatter`.
    """
    cp = _import_cupy()
    if not isinstance(staging, cp.ndarray) or not isinstance(out, cp.ndarray):
        raise PlanError("cupy_unpack_scatter takes CuPy arrays for staging and out")
    if not (staging.flags.c_contiguous and out.flags.c_contiguous):
        raise PlanError("staging and out must be C-contiguous")
    if staging.device.id != out.device.id:
        raise PlanError(f"staging is on device {staging.device.id}, out on {out.device.id}")
    plan, fill, _ = check_unpack_call(staging.dtype.name, staging.size, out.dtype.name, out.size, plan, topk, bits,
                                      fill, validate)
    _launch_unpack(cp, staging.data.ptr, out.data.ptr, plan, topk, bits, fill, out.device.id, _cupy_stream(cp, stream))
    return out


def torch_unpack_scatter_cupy(staging, plan, topk: int, bits: int, out, fill=0, *, validate=True, stream=None):
    """:func:`cupy_unpack_scatter` of CUDA torch tensors, on torch's current stream of ``out``'s device unless
    ``stream`` is given."""
    cp = _import_cupy()
    if not (staging.is_cuda and out.is_cuda) or staging.device != out.device:
        raise PlanError(f"staging ({staging.device}) and out ({out.device}) must share one CUDA device")
    if not out.is_contiguous() or not staging.is_contiguous():
        raise PlanError("staging and out must be contiguous")
    plan, fill, _ = check_unpack_call(dtype_name(staging.dtype), staging.numel(), dtype_name(out.dtype), out.numel(),
                                      plan, topk, bits, fill, validate)
    _launch_unpack(cp, staging.data_ptr(), out.data_ptr(), plan, topk, bits, fill, out.device.index,
                   _cupy_stream(cp, stream, torch_device=out.device))
    return out


def _launch_unpack(cp, src_ptr: int, dst_ptr: int, plan, topk: int, bits: int, fill, device_id: int, cs) -> None:
    kernel = _module(cp, device_id, None).get_function(UNPACK_KERNEL)
    with cp.cuda.Device(device_id):
        cs = cs if cs is not None else cp.cuda.get_current_stream()
        _ring(cp, device_id).launch(plan, 1, THREADS, cs, kernel,
                                    (np.uint64(src_ptr), np.uint64(dst_ptr), fill, np.int32(topk), np.int32(bits)))


def widen_scatter_from_pointer(src_ptr: int, src_dtype, src_elems: int, plan, out, fill=0, *,
                               validate=True, stream=None, steps=DEFAULT_STEPS):
    """Widen+scatter from a raw device-accessible address into ``out`` (one launch).

    The zero-copy restore: ``src_ptr`` may be page-locked host memory
    registered as mapped, which the kernel reads over PCIe, so only the
    compact bytes cross the bus and nothing is staged.

    Parameters
    ----------
    src_ptr : int
        Device address of the compact source (element 0).
    src_dtype : str or dtype
        uint8, uint16, int32 or float32.
    src_elems : int
        Elements readable from ``src_ptr`` (bounds the plan's sources).
    plan : array-like of int, shape [n, 3]
        In *elements*: ``(src_elem, dst_elem, elems)``, ``src_elem`` -1 for
        fill; destination ranges must not overlap.
    out : cupy.ndarray or CUDA torch.Tensor
        Contiguous int32 (float32 for float32 sources) output.
    fill, validate, stream, steps
        As :func:`cupy_widen_scatter`.

    Returns
    -------
    ``out``.
    """
    cp = _import_cupy()
    in_dtype = dtype_name(src_dtype)
    if isinstance(out, cp.ndarray):
        if not out.flags.c_contiguous:
            raise PlanError("out must be C-contiguous")
        dst_ptr, out_dtype, out_len, device_id = out.data.ptr, out.dtype.name, out.size, out.device.id
        cs = _cupy_stream(cp, stream)
    else:
        if not out.is_cuda or not out.is_contiguous():
            raise PlanError("out must be a contiguous CUDA tensor")
        dst_ptr, out_dtype, out_len, device_id = out.data_ptr(), dtype_name(out.dtype), out.numel(), out.device.index
        cs = _cupy_stream(cp, stream, torch_device=out.device)
    plan, fill = check_call(in_dtype, int(src_elems), out_dtype, out_len, plan, 1, fill, validate)
    _launch(cp, int(src_ptr), in_dtype, dst_ptr, plan, 1, fill, device_id, cs, steps)
    return out

