"""The packed expert-ID kernel: its numpy reference against an independent bit-by-bit decoder for every width
and top-k, and the CUDA source itself, run on the CPU, against the reference.

The host harness compiles ``unpack_scatter.cu`` with a host C++ compiler
(CUDA's qualifiers defined away) and runs every thread of every block in
turn: the kernel's threads write disjoint rows and share nothing, so that is
what the GPU computes. Changing the kernel's shift or mask (try it) fails
``test_kernel_source_matches_the_reference``.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from gputq.errors import PlanError
from gputq.kernels.cupy_backend import THREADS, UNPACK_SOURCE, fragment_table
from gputq.kernels.plan import packed_row_bytes
from gputq.kernels.reference import reference_unpack_scatter
from tests.data.test_packing import _decode_bitwise, _encode_bitwise
from tests.kernels.test_reference import random_plan

pytestmark = pytest.mark.timeout(120)

_HARNESS = r"""
#define __global__
#define __launch_bounds__(x)
struct Dim3 { unsigned int x, y, z; };
static Dim3 blockIdx, threadIdx;
#include "SOURCE"
extern "C" void launch(const unsigned char* src, int* dst, const long long* table, int nfrag, long long nblocks,
                       int fill, int topk, int bits) {
    for (long long b = 0; b < nblocks; ++b) {
        blockIdx.x = (unsigned int)b;
        for (unsigned int t = 0; t < UP_THREADS; ++t) {
            threadIdx.x = t;
            unpack_scatter_i32(src, dst, table, nfrag, fill, topk, bits);
        }
    }
}
"""


_built: list = []


def unpack_kernel(tmp_path_factory):
    """The CPU build of ``unpack_scatter.cu``: ``launch(src, dst, table, nfrag, nblocks, fill, topk, bits)``
    runs the whole grid (shared with the stand-in CuPy, ``tests/host_cuda.py``)."""
    if not _built:
        if shutil.which("g++") is None:
            pytest.skip("no host C++ compiler (g++) to run the kernel source on the CPU")
        folder = tmp_path_factory.mktemp("unpack")
        (folder / "harness.cpp").write_text(_HARNESS.replace("SOURCE", str(UNPACK_SOURCE)))
        lib = folder / "harness.so"
        subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", f"-DUP_THREADS={THREADS}", "-o", str(lib),
                        str(folder / "harness.cpp")], check=True, capture_output=True, timeout=120)
        fn = ctypes.CDLL(str(lib)).launch
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _built.append(fn)
    return _built[0]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return unpack_kernel(tmp_path_factory)


def _rows(rng, n: int, topk: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(0, 1 << bits, (n, topk))
    ids[0] = (1 << bits) - 1
    return ids, _encode_bitwise(ids, bits)


@pytest.mark.parametrize("bits", range(1, 17))
def test_the_reference_matches_a_bitwise_decoder_for_every_topk(bits):
    rng = np.random.default_rng(bits)
    for topk in range(1, 17):
        ids, packed = _rows(rng, 24, topk, bits)
        plan = random_plan(rng, 24, 40, max_frag=7)
        out = np.full(40 * topk, -7, np.int32)
        reference_unpack_scatter(packed.reshape(-1), plan, topk, bits, out, fill=3)
        want = np.full((40, topk), -7, np.int64)
        decoded = _decode_bitwise(packed, topk, bits)
        for src, dst, n in plan.tolist():
            want[dst:dst + n] = 3 if src < 0 else decoded[src:src + n]
        np.testing.assert_array_equal(out.reshape(40, topk), want, err_msg=f"b={bits} K={topk}")


# Every first-bit offset meets every span: one, two and three bytes, and an ID ending exactly on a byte.
@pytest.mark.parametrize("topk, bits", [(1, 1), (8, 7), (8, 9), (10, 9), (8, 11), (8, 13), (16, 12), (16, 16), (5, 15),
                                        (7, 3)])
def test_kernel_source_matches_the_reference(launch, topk, bits):
    rng = np.random.default_rng(topk * 31 + bits)
    src_rows, dst_rows = 700, 1100  # fragments span several blocks of rows
    _, packed = _rows(rng, src_rows, topk, bits)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=400)
    want = reference_unpack_scatter(packed.reshape(-1), plan, topk, bits, np.full(dst_rows * topk, -9, np.int32), 5)
    got = np.full(dst_rows * topk, -9, np.int32)
    table, nblocks = fragment_table(plan, 1, THREADS)
    launch(packed.ctypes.data, got.ctypes.data, table.ctypes.data, len(plan), nblocks, 5, topk, bits)
    np.testing.assert_array_equal(got, want)


def test_cupy_unpack_scatter_launches_the_kernel_on_the_stand_in(host_cuda):
    """The CuPy launcher itself: its table, its arguments' C types and its grid, on the stand-in CuPy, whose
    launch runs the CPU build of the CUDA source, against the reference."""
    from gputq.kernels import cupy_unpack_scatter

    rng = np.random.default_rng(12)
    for topk, bits in ((8, 9), (10, 9), (8, 7), (3, 16)):
        _, packed = _rows(rng, 600, topk, bits)
        plan = random_plan(rng, 600, 900, max_frag=300)
        want = reference_unpack_scatter(packed.reshape(-1), plan, topk, bits, np.full(900 * topk, -1, np.int32), 4)
        out = host_cuda.device_array(np.full(900 * topk, -1, np.int32))
        staging = packed.reshape(-1)  # alive until the launch ran (the stand-in faults on freed memory, as a GPU)
        cupy_unpack_scatter(host_cuda.device_array(staging), plan, topk, bits, out, 4)
        np.testing.assert_array_equal(host_cuda.to_host(out), want, err_msg=f"K={topk} b={bits}")
    assert sum(entry[0] == "launch" for entry in host_cuda.log) == 4
    # The launcher checks as the reference does: a staging buffer of part of a row is refused, nothing launched.
    ragged = np.zeros(9 * 4 - 1, np.uint8)
    with pytest.raises(PlanError, match="whole rows"):
        cupy_unpack_scatter(host_cuda.device_array(ragged), [[0, 0, 1]], 8, 9,
                            host_cuda.device_array(np.zeros(32, np.int32)))
    assert sum(entry[0] == "launch" for entry in host_cuda.log) == 4


def test_bad_calls_are_plan_errors():
    packed = np.zeros(9 * 4, np.uint8)
    out = np.zeros(4 * 8, np.int32)
    assert packed_row_bytes(8, 9) == 9
    with pytest.raises(PlanError, match="whole rows"):
        reference_unpack_scatter(packed[:-1], [[0, 0, 1]], 8, 9, out)
    with pytest.raises(PlanError, match="bits in"):
        reference_unpack_scatter(packed, [[0, 0, 1]], 8, 17, out)
    with pytest.raises(PlanError):
        reference_unpack_scatter(packed, [[3, 0, 2]], 8, 9, out)  # past the source's 4 rows
    with pytest.raises(PlanError, match="int32"):
        reference_unpack_scatter(packed, [[0, 0, 1]], 8, 9, out.astype(np.int64))
