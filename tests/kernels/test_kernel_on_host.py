"""The CUDA source itself, run on the CPU, bit for bit against the numpy reference.

The kernel uses no shared memory and no barriers, and its threads write
disjoint elements, so running every thread of every block one after the
other is exactly what the GPU computes. A small harness compiles
``widen_scatter.cu`` with a host C++ compiler (CUDA's qualifiers defined
away, its vector types declared) and launches the grid in a loop. This
checks the kernel's index arithmetic, alignment paths (16-byte, 4-byte and
element loads), heads, tails and fill fragments where no GPU is present;
the GPU tests check the same on the device.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gputq.kernels import reference_widen_scatter
from gputq.kernels.cupy_backend import THREADS, chunk_elements, fragment_table
from gputq.kernels.plan import check_call
from tests.kernels.test_reference import DTYPES, bits, poisoned_out, random_plan, random_staging

_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "widen_scatter.cu"
_HARNESS = r"""
#include <cstddef>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct Dim3 { unsigned int x, y, z; };
static Dim3 blockIdx, threadIdx;
#include "SOURCE"
extern "C" void launch(int kind, const unsigned char* src, void* dst, const long long* table, int nfrag,
                       long long nblocks, int ifill, float ffill) {
    for (long long b = 0; b < nblocks; ++b) {
        blockIdx.x = (unsigned int)b;
        for (unsigned int t = 0; t < WS_THREADS; ++t) {
            threadIdx.x = t;
            switch (kind) {
                case 0: widen_scatter_u8_i32(src, (int*)dst, table, nfrag, ifill); break;
                case 1: widen_scatter_u16_i32(src, (int*)dst, table, nfrag, ifill); break;
                case 2: widen_scatter_i32_i32(src, (int*)dst, table, nfrag, ifill); break;
                default: widen_scatter_f32_f32(src, (float*)dst, table, nfrag, ffill); break;
            }
        }
    }
}
"""
_KINDS = {"uint8": 0, "uint16": 1, "int32": 2, "float32": 3}
_libs: dict = {}


def _kernel(tmp_path_factory, steps: int):
    if steps not in _libs:
        if shutil.which("g++") is None:
            pytest.skip("no host C++ compiler (g++) to run the kernel source on the CPU")
        folder = tmp_path_factory.mktemp(f"ws{steps}")
        (folder / "harness.cpp").write_text(_HARNESS.replace("SOURCE", str(_SOURCE)))
        lib = folder / "harness.so"
        subprocess.run(["g++", "-std=c++17", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC",
                        f"-DWS_STEPS={steps}", f"-DWS_THREADS={THREADS}", "-o", str(lib),
                        str(folder / "harness.cpp")], check=True, capture_output=True, timeout=120)
        fn = ctypes.CDLL(str(lib)).launch
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_longlong, ctypes.c_int, ctypes.c_float]
        _libs[steps] = fn
    return _libs[steps]


def _shifted(host: np.ndarray, shift: int) -> np.ndarray:
    """A copy of ``host`` starting ``shift`` elements past a 64-byte boundary."""
    raw = np.zeros(host.nbytes + 128 + shift * host.itemsize, np.uint8)
    start = (-raw.ctypes.data) % 64 + shift * host.itemsize
    view = raw[start:start + host.nbytes].view(host.dtype)
    view[:] = host
    return view


def scattered_source(rng, staging: np.ndarray, width: int, blobs: int):
    """``staging`` cut at row boundaries into ``blobs`` blobs laid out of order, 256-byte aligned,
    as an arena holds them; returns the :class:`~kernels.MappedSource` over them and the memory
    holding them (keep it alive while the source is read)."""
    from gputq.kernels import MappedSource

    rows, row_bytes = staging.size // width, width * staging.itemsize
    cuts = np.unique(np.concatenate([[0, rows], rng.integers(1, rows, blobs - 1)]))
    starts, lengths = cuts[:-1] * row_bytes, np.diff(cuts) * row_bytes
    memory = _shifted(np.zeros(int(lengths.sum()) + 512 * len(lengths), np.uint8), 0)
    addresses, cursor = np.zeros(len(starts), np.int64), 256
    for i in rng.permutation(len(starts)):
        addresses[i] = memory.ctypes.data + cursor
        memory[cursor:cursor + lengths[i]] = staging.view(np.uint8)[starts[i]:starts[i] + lengths[i]]
        cursor += -(-int(lengths[i]) // 256) * 256
    return MappedSource(starts, addresses, lengths, staging.nbytes).view(staging.dtype), memory


def _run(launch, staging, plan, width, out, fill, steps):
    plan, fill = check_call(staging.dtype.name, staging.size, out.dtype.name, out.size, plan, width, fill, True)
    table, nblocks = fragment_table(plan, width, chunk_elements(staging.itemsize, steps))
    launch(_KINDS[staging.dtype.name], staging.ctypes.data, out.ctypes.data, table.ctypes.data, len(plan),
           nblocks, int(fill) if out.dtype == np.int32 else 0, float(fill) if out.dtype == np.float32 else 0.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("steps", [1, 4])
def test_kernel_source_matches_reference_at_every_alignment(tmp_path_factory, dtype, steps):
    launch = _kernel(tmp_path_factory, steps)
    rng = np.random.default_rng(steps * 7 + len(dtype))
    for width, max_frag in ((1, 3000), (3, 40), (384, 30)):
        src_rows, dst_rows = 20_000 // width + 5, 30_000 // width + 9
        staging = random_staging(rng, dtype, src_rows * width)
        plan = random_plan(rng, src_rows, dst_rows, max_frag=max_frag)
        fill = 11 if dtype != "float32" else -0.0
        want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), fill)
        for s_shift, d_shift in ((0, 0), (1, 3), (2, 0), (4, 2), (3, 1)):
            src = _shifted(staging, s_shift)
            out = _shifted(poisoned_out(dtype, dst_rows * width), d_shift)
            _run(launch, src, plan, width, out, fill, steps)
            np.testing.assert_array_equal(bits(out), bits(want),
                                          err_msg=f"width {width}, shifts {s_shift, d_shift}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_source_tiny_huge_and_empty_fragments(tmp_path_factory, dtype):
    launch = _kernel(tmp_path_factory, 4)
    rng = np.random.default_rng(5)
    n = 3 * chunk_elements(1) + 77  # one fragment spanning several blocks, uint8 included
    staging = random_staging(rng, dtype, n + 64)
    plan = np.array([[5, 0, n], [0, n + 1, 1], [-1, n + 2, 2], [3, n + 4, 0], [7, n + 4, 3],
                     [-1, n + 7, 19], [1, n + 30, 17]], np.int64)
    out_len = n + 64
    want = reference_widen_scatter(staging, plan, 1, poisoned_out(dtype, out_len), 4)
    for d_shift in range(4):
        out = _shifted(poisoned_out(dtype, out_len), d_shift)
        _run(launch, _shifted(staging, 1), plan, 1, out, 4, 4)
        np.testing.assert_array_equal(bits(out), bits(want), err_msg=f"dst shift {d_shift}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_kernel_source_reads_a_mapped_source_in_place(tmp_path_factory, dtype):
    """The zero-copy launch: a row plan over staging translated to blobs scattered in memory."""
    launch = _kernel(tmp_path_factory, 4)
    rng = np.random.default_rng(8)
    width, src_rows, dst_rows = 48, 600, 900
    staging = random_staging(rng, dtype, src_rows * width)
    source, _memory = scattered_source(rng, staging, width, blobs=10)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=1)  # fragments never cross a blob
    elements, base, src_elems = source.element_plan(plan, width)
    table, nblocks = fragment_table(elements, 1, chunk_elements(staging.itemsize))
    out = poisoned_out(dtype, dst_rows * width)
    launch(_KINDS[dtype], base, out.ctypes.data, table.ctypes.data, len(elements), nblocks, 6, 0.0)
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 6)
    np.testing.assert_array_equal(out, want)
