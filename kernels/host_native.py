"""The host codec of expert IDs (``host_codec.c``, ``host_pack.c``), built with the host's C compiler on first use.

numpy packs and unpacks a row of IDs one ID column at a time: a pass over
the whole step per column, an order of magnitude slower than the cast a
whole-byte format costs. The codec takes a row at a time, and on put's side
also narrows whole-byte formats, checking each ID, straight into the stored
layer-major order (numpy transposes an element at a time). It is
compiled once per source and compiler into a cache folder
(``$GPUTQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/gputq`` or
``~/.cache/gputq``) and loaded with ctypes; nothing is built at install
time, and ``import gputq`` still needs numpy alone.

Where there is no C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``),
the build fails, or ``GPUTQ_HOST_CODEC=numpy``, :func:`host_codec` returns
None and callers use the numpy reference: the same bytes, slower. On
x86-64 CPUs with fast BMI2 the codec moves eight IDs at a time (and
unpacks sixteen with AVX-512 VBMI, checks sixteen and narrows eight with
AVX-512);
``GPUTQ_HOST_CODEC=bytewise`` keeps it at one (the same bytes). Which one
runs, and why, is kept in :func:`host_codec_status`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from gputq.errors import PlanError

from .plan import as_plan_array, check_call, check_unpack_call
from .reference import reference_unpack_scatter, reference_widen_scatter, unpack_rows_into

__all__ = ["HOST_CODEC_SOURCES", "PATH_AVX512", "PATH_BMI2", "PATH_VBMI", "host_codec", "host_codec_status",
           "unpack_rows_host", "unpack_scatter_host", "unpack_token_major_host", "pack_rows_host", "narrow_rows_host",
           "widen_scatter_host", "widen_scatter_mapped_host", "unpack_scatter_mapped_host"]

#: The codec's C sources, built into one library (the header is part of what the build depends on).
HOST_CODEC_SOURCES = tuple(Path(__file__).with_name(name) for name in ("host_codec.c", "host_pack.c", "host_widen.c"))
_HEADER = Path(__file__).with_name("host_codec.h")
_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
_BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library or None, "status": why


def host_codec():
    """The loaded codec (a ``ctypes.CDLL`` with its functions typed), or None to use numpy; built once."""
    with _lock:
        if "lib" not in _state:
            try:
                lib = _load()
                bytewise = os.environ.get("GPUTQ_HOST_CODEC", "").lower() == "bytewise"
                _state["lib"], _state["status"] = lib, f"built with the host C compiler ({_paths(lib, bytewise)})"
            except _Unavailable as exc:
                _state["lib"], _state["status"] = None, str(exc)
        return _state["lib"]


def host_codec_status() -> str:
    """Why :func:`host_codec` gives what it gives (loading it first)."""
    host_codec()
    return _state["status"]


#: The codec's vector paths (``gputq_set_paths``): eight IDs at a time by BMI2, sixteen unpacked by AVX-512
#: VBMI, checked and narrowed by AVX-512.
PATH_BMI2, PATH_VBMI, PATH_AVX512 = 1, 2, 4


def _paths(lib, bytewise: bool) -> str:
    """Allow the vector paths the CPU runs (none with ``bytewise``); what runs, in words."""
    paths = lib.gputq_set_paths(0 if bytewise else PATH_BMI2 | PATH_VBMI | PATH_AVX512)
    if not paths:
        return "an ID at a time" + (" (GPUTQ_HOST_CODEC=bytewise)" if bytewise else "")
    named = [("BMI2, eight IDs at a time", PATH_BMI2), ("AVX-512 VBMI unpack, sixteen", PATH_VBMI),
             ("AVX-512 check and narrowing", PATH_AVX512)]
    return ", ".join(name for name, path in named if paths & path)


class _Unavailable(Exception):
    pass


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise _Unavailable("no C compiler (set CC, or install cc/gcc/clang): packed IDs use numpy")


def _cache_dir() -> Path:
    root = os.environ.get("GPUTQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "gputq")
    return Path(root)


def _load():
    if os.environ.get("GPUTQ_HOST_CODEC", "").lower() == "numpy":
        raise _Unavailable("GPUTQ_HOST_CODEC=numpy: packed IDs use numpy")
    compiler = _compiler()
    source = b"".join(path.read_bytes() for path in (*HOST_CODEC_SOURCES, _HEADER))
    digest = hashlib.sha256(source + compiler.encode() + " ".join(_FLAGS).encode()
                            + sys.platform.encode()).hexdigest()[:16]
    lib = _cache_dir() / f"host_codec-{digest}.so"
    if not lib.exists():
        _build(compiler, lib)
    try:
        return _typed(ctypes.CDLL(str(lib)))
    except OSError as exc:
        raise _Unavailable(f"loading {lib} failed ({exc}): packed IDs use numpy") from None


def _build(compiler: str, lib: Path) -> None:
    """Compile into a temporary file, then rename: processes building at once never load a half-written one."""
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as folder:
            out = Path(folder) / lib.name
            subprocess.run([compiler, *_FLAGS, "-o", str(out), *map(str, HOST_CODEC_SOURCES)], check=True,
                           capture_output=True, timeout=_BUILD_TIMEOUT_S)
            os.replace(out, lib)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise _Unavailable(f"building the host codec with {compiler} failed ({exc}; "
                           f"{detail.decode(errors='replace')[:400]}): packed IDs use numpy") from None


def _typed(lib):
    c = ctypes
    lib.gputq_unpack_rows.argtypes = [c.c_void_p, c.c_int64, c.c_int, c.c_int, c.c_void_p, c.c_int64]
    lib.gputq_unpack_rows.restype = None
    lib.gputq_unpack_scatter.argtypes = [c.c_void_p, c.c_void_p, c.c_int64, c.c_int, c.c_int, c.c_void_p, c.c_int32]
    lib.gputq_unpack_scatter.restype = None
    lib.gputq_unpack_token_major.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_int,
                                             c.c_void_p]
    lib.gputq_unpack_token_major.restype = None
    lib.gputq_pack_rows.argtypes = [c.c_void_p, c.c_int64, c.c_int, c.c_int, c.c_int, c.c_int64, c.c_void_p,
                                    c.c_int64, c.c_int64]
    lib.gputq_pack_rows.restype = c.c_int64
    lib.gputq_narrow_rows.argtypes = lib.gputq_pack_rows.argtypes
    lib.gputq_narrow_rows.restype = c.c_int64
    lib.gputq_widen_scatter.argtypes = [c.c_void_p, c.c_int, c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p,
                                        c.c_int64, c.c_uint32]
    lib.gputq_widen_scatter.restype = c.c_int64
    lib.gputq_widen_scatter_mapped.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_int, c.c_void_p,
                                               c.c_int64, c.c_int64, c.c_void_p, c.c_int64, c.c_uint32]
    lib.gputq_widen_scatter_mapped.restype = c.c_int64
    lib.gputq_unpack_scatter_mapped.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p,
                                                c.c_int64, c.c_int, c.c_int, c.c_void_p, c.c_int64, c.c_int32]
    lib.gputq_unpack_scatter_mapped.restype = c.c_int64
    lib.gputq_set_paths.argtypes = [c.c_int]
    lib.gputq_set_paths.restype = c.c_int
    return lib


def unpack_rows_host(rows: np.ndarray, topk: int, bits: int, out: np.ndarray) -> np.ndarray:
    """:func:`~kernels.reference.unpack_rows_into` (uint8 ``[n, row_bytes]`` into int32 ``[n, topk]``, any row
    stride of ``out``), by the codec where it loads and the arrays allow."""
    lib = host_codec()
    if lib is None or not rows.flags.c_contiguous or out.dtype != np.int32 or out.ndim != 2 \
            or out.strides[1] != 4 or out.strides[0] % 4 or not out.flags.writeable:
        return unpack_rows_into(rows, topk, bits, out)
    lib.gputq_unpack_rows(rows.ctypes.data, len(rows), topk, bits, out.ctypes.data, out.strides[0] // 4)
    return out


def unpack_token_major_host(runs: np.ndarray, topk: int, bits: int, out: np.ndarray) -> np.ndarray:
    """A fragment's layer runs of packed IDs (uint8 ``[L, rows, bytes]``, rows contiguous, layers at any
    whole-row stride) into token-major int32 ``out`` ``[rows, L, K]``, by the codec where it loads and the
    arrays allow."""
    lib = host_codec()
    layers, rows, row_bytes = runs.shape
    strided = runs.strides[2] == 1 and runs.strides[1] == row_bytes and runs.strides[0] % max(row_bytes, 1) == 0
    if lib is None or not strided or not out.flags.c_contiguous or out.dtype != np.int32 or not out.flags.writeable:
        for layer in range(layers):
            unpack_rows_into(runs[layer], topk, bits, out[:, layer])
        return out
    lib.gputq_unpack_token_major(runs.ctypes.data, runs.strides[0] // max(row_bytes, 1), 0, rows, layers, topk, bits,
                                 out.ctypes.data)
    return out


def unpack_scatter_host(staging: np.ndarray, plan, topk: int, bits: int, out: np.ndarray, fill=0, *,
                        validate: bool = True) -> np.ndarray:
    """:func:`~kernels.reference.reference_unpack_scatter`, by the codec where it loads (same checks, errors
    and bytes)."""
    lib = host_codec()
    if lib is None or not isinstance(staging, np.ndarray) or not isinstance(out, np.ndarray) \
            or not staging.flags.c_contiguous or not out.flags.c_contiguous or not out.flags.writeable:
        return reference_unpack_scatter(staging, plan, topk, bits, out, fill, validate=validate)
    plan, fill, _ = check_unpack_call(staging.dtype.name, staging.size, out.dtype.name, out.size, plan, topk, bits,
                                      fill, validate)
    plan = np.ascontiguousarray(plan, dtype=np.int64)
    lib.gputq_unpack_scatter(staging.ctypes.data, plan.ctypes.data, len(plan), int(topk), int(bits),
                             out.ctypes.data, int(fill))
    return out


def widen_scatter_host(staging: np.ndarray, plan, width: int, out: np.ndarray, fill=0, *,
                       validate: bool = True) -> np.ndarray:
    """:func:`~kernels.reference.reference_widen_scatter`, by the codec where it loads and the arrays allow:
    the same checks, errors and bytes, the whole plan in one call. A plan row outside the buffers raises
    ``PlanError`` even unvalidated (nothing is read or written outside them)."""
    lib = host_codec()
    if lib is None or not isinstance(staging, np.ndarray) or not isinstance(out, np.ndarray) \
            or not staging.flags.c_contiguous or not out.flags.c_contiguous or not out.flags.writeable \
            or not staging.dtype.isnative:
        return reference_widen_scatter(staging, plan, width, out, fill, validate=validate)
    plan, fill = check_call(staging.dtype.name, staging.size, out.dtype.name, out.size, plan, width, fill, validate)
    plan = np.ascontiguousarray(plan, dtype=np.int64)
    bad = lib.gputq_widen_scatter(staging.ctypes.data, staging.dtype.itemsize, staging.size // width, plan.ctypes.data,
                                  len(plan), width, out.ctypes.data, out.size // width,
                                  int(np.asarray(fill, out.dtype).view(np.uint32)))
    if bad >= 0:
        raise PlanError(f"plan row {bad} {plan[bad].tolist()} reads or writes outside the buffers "
                        f"({staging.size // width} staging rows, {out.size // width} out rows)")
    return out


#: What the mapped widen takes: the stored element type and the output type it widens into.
_MAPPED_WIDENS = {("uint8", "int32"), ("uint16", "int32"), ("int32", "int32"), ("float32", "float32")}


def widen_scatter_mapped_host(segments: tuple, dtype, plan, width: int, out: np.ndarray,
                              fill=0) -> np.ndarray | None:
    """:func:`widen_scatter_host` reading the staging bytes where they lie: ``segments`` are a mapped
    source's ``(starts, addresses, lengths)`` (int64 arrays, staging byte offsets ascending, host
    addresses) of elements of ``dtype``. None where the codec cannot take it (not loaded, a pair of
    types other than uint8, uint16 or int32 into int32 and float32 into float32, or ``out`` not writable
    and C-contiguous): the caller translates the plan itself. Raises ``PlanError`` for a plan row outside
    one segment, misaligned or outside ``out``; nothing of it or after it is written."""
    lib = host_codec()
    dtype = np.dtype(dtype)
    if lib is None or (dtype.name, out.dtype.name) not in _MAPPED_WIDENS or not dtype.isnative \
            or not out.flags.c_contiguous or not out.flags.writeable:
        return None
    itemsize = dtype.itemsize
    plan = np.ascontiguousarray(as_plan_array(plan), dtype=np.int64)
    starts, addresses, lengths = (np.ascontiguousarray(a, dtype=np.int64) for a in segments)
    bad = lib.gputq_widen_scatter_mapped(starts.ctypes.data, addresses.ctypes.data, lengths.ctypes.data, len(starts),
                                         itemsize, plan.ctypes.data, len(plan), width, out.ctypes.data,
                                         out.size // width, int(np.asarray(fill, out.dtype).view(np.uint32)))
    if bad >= 0:
        raise PlanError(f"plan row {bad} {plan[bad].tolist()} reads staging bytes that no mapped segment holds "
                        f"whole and aligned, or writes outside the {out.size // width} out rows")
    return out


def unpack_scatter_mapped_host(segments: tuple, plan, topk: int, bits: int, out: np.ndarray,
                               fill=0) -> np.ndarray | None:
    """:func:`unpack_scatter_host` reading the packed rows where they lie: ``segments`` as for
    :func:`widen_scatter_mapped_host`. None where the codec cannot take it (not loaded, or ``out`` not
    writable, C-contiguous int32): the caller reads the rows itself. Raises ``PlanError`` for a plan row
    outside one segment or outside ``out``; nothing of it or after it is written."""
    lib = host_codec()
    if lib is None or out.dtype != np.int32 or not out.flags.c_contiguous or not out.flags.writeable:
        return None
    plan = np.ascontiguousarray(as_plan_array(plan), dtype=np.int64)
    starts, addresses, lengths = (np.ascontiguousarray(a, dtype=np.int64) for a in segments)
    bad = lib.gputq_unpack_scatter_mapped(starts.ctypes.data, addresses.ctypes.data, lengths.ctypes.data,
                                          len(starts), plan.ctypes.data, len(plan), int(topk), int(bits),
                                          out.ctypes.data, out.size // int(topk), int(fill))
    if bad >= 0:
        raise PlanError(f"plan row {bad} {plan[bad].tolist()} reads staging bytes that no mapped segment holds "
                        f"whole, or writes outside the {out.size // int(topk)} out rows")
    return out


def pack_rows_host(ids: np.ndarray, bits: int, num_experts: int, out: np.ndarray, layer_major: bool) -> int | None:
    """Pack int32 ``ids`` ``[rows, layers, K]`` into uint8 ``out`` (``[rows, layers, bytes]``, or
    ``[layers, rows, bytes]`` with ``layer_major``), checking each ID below ``num_experts``.

    Returns None when the codec cannot take them (not loaded, or ``ids``
    not C-contiguous native int32: the caller packs with numpy), -1 when
    packed, else the flat index of the first ID out of range.
    """
    lib = _taking(ids, out)
    if lib is None:
        return None
    return int(lib.gputq_pack_rows(ids.ctypes.data, *ids.shape, bits, num_experts, out.ctypes.data,
                                   *_row_strides(ids, out.shape[-1], layer_major)))


def narrow_rows_host(ids: np.ndarray, limit: int, out: np.ndarray, layer_major: bool) -> int | None:
    """Store int32 ``ids`` ``[rows, layers, K]`` as ``out``'s whole-byte dtype (uint8, uint16 or int32; its
    shape as :func:`pack_rows_host`'s), checking each ID in ``[0, limit)`` (``limit`` 0: no check).

    Returns what :func:`pack_rows_host` returns: None where the codec
    cannot take them, -1 when stored, else the flat index of the first ID
    out of range.
    """
    lib = _taking(ids, out)
    if lib is None or out.dtype not in (np.dtype("=u1"), np.dtype("=u2"), np.dtype("=i4")):
        return None
    return int(lib.gputq_narrow_rows(ids.ctypes.data, *ids.shape, limit, out.dtype.itemsize, out.ctypes.data,
                                     *_row_strides(ids, out.shape[-1] * out.dtype.itemsize, layer_major)))


def _taking(ids: np.ndarray, out: np.ndarray):
    """The codec, where it loads and takes ``ids`` (C-contiguous native int32 ``[rows, layers, K]``) into
    ``out`` (C-contiguous); else None."""
    lib = host_codec()
    if lib is None or ids.dtype != np.dtype("=i4") or not ids.flags.c_contiguous or ids.ndim != 3 \
            or not out.flags.c_contiguous:
        return None
    return lib


def _row_strides(ids: np.ndarray, row_bytes: int, layer_major: bool) -> tuple[int, int]:
    """Bytes from one stored row to the next token's and to the next layer's."""
    rows, layers, _ = ids.shape
    return (row_bytes, rows * row_bytes) if layer_major else (layers * row_bytes, row_bytes)
