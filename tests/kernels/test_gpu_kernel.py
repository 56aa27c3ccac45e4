"""The CUDA kernel (through CuPy and through torch tensors) and the torch
fallback on CUDA, bit for bit against the numpy reference.

Outputs start poisoned, so a covered element the kernel skipped, or an
uncovered one it touched, shows up as a mismatch. One case builds a large
output (``GPUTQ_KERNEL_TEST_GIB``, default 2 GiB) and checks it on the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from gputq.errors import PlanError
from gputq.kernels import cuda_available, reference_widen_scatter, widen_scatter
from gputq.kernels.cupy_backend import cupy_usable
from tests.kernels.test_reference import (
    DTYPES,
    bits,
    out_dtype,
    poisoned_out,
    random_plan,
    random_staging,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="no CUDA device"),
]
needs_cupy = pytest.mark.skipif(not cupy_usable(), reason="CuPy sees no CUDA device")


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _case(seed, dtype, width, src_rows, dst_rows, max_frag):
    rng = np.random.default_rng(seed)
    staging = random_staging(rng, dtype, src_rows * width)
    plan = random_plan(rng, src_rows, dst_rows, max_frag)
    fill = 11 if dtype != "float32" else -0.0
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), fill)
    return staging, plan, fill, want


def _shifted(cp, host, shift):
    """A device copy of ``host`` that starts ``shift`` elements into its allocation."""
    buf = cp.empty(host.size + shift, host.dtype)
    view = buf[shift:]
    view.set(host)
    return view


@needs_cupy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 3, 8, 384, 600])
def test_cupy_kernel_matches_reference(dtype, width):
    import cupy as cp

    dst_rows = 40_000 // width + 5
    staging, plan, fill, want = _case(width + 7 * len(dtype), dtype, width, dst_rows // 2 + 1,
                                      dst_rows, max_frag=300 if width < 8 else 40)
    for s_shift, d_shift in ((0, 0), (1, 3), (3, 1), (2, 2)):
        stg = _shifted(cp, staging, s_shift)
        out = _shifted(cp, poisoned_out(dtype, want.size), d_shift)
        assert widen_scatter(stg, plan, width, out, fill) is out
        np.testing.assert_array_equal(bits(out.get()), bits(want), err_msg=f"shifts {s_shift, d_shift}")


@needs_cupy
@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_kernel_misaligned_fragments_in_one_launch(dtype):
    """Every (src offset mod 16, dst offset mod 16, length) mix in one plan."""
    import cupy as cp

    rows, pos, src = [], 0, 0
    for s_mis in range(16):
        for d_mis in range(16):
            for n in (1, 2, 3, 4, 5, 7, 33, 8195):
                pos += (d_mis - pos) % 16
                src_row = 16 * (src // 16 + 1) + s_mis
                rows.append((src_row if n != 2 else -1, pos, n))
                pos += n
                src = src_row + n
    plan = np.array(rows, np.int64)
    rng = np.random.default_rng(1)
    staging = random_staging(rng, dtype, src + 16)
    want = reference_widen_scatter(staging, plan, 1, poisoned_out(dtype, pos + 5), 4)
    out = cp.asarray(poisoned_out(dtype, pos + 5))
    widen_scatter(cp.asarray(staging), plan, 1, out, 4)
    np.testing.assert_array_equal(bits(out.get()), bits(want))


@needs_cupy
@pytest.mark.parametrize("dst_rows", [1, 2, 5, 17, 1000, 100_000])
def test_cupy_kernel_sizes(dst_rows):
    import cupy as cp

    width = 384
    staging, plan, fill, want = _case(dst_rows, "uint8", width, dst_rows, dst_rows, max_frag=5000)
    out = cp.asarray(poisoned_out("uint8", dst_rows * width))
    widen_scatter(cp.asarray(staging), plan, width, out, fill)
    np.testing.assert_array_equal(out.get(), want)


@needs_cupy
def test_cupy_kernel_large_output_checked_on_gpu():
    import cupy as cp

    gib = float(os.environ.get("GPUTQ_KERNEL_TEST_GIB", "2"))
    width = 384
    dst_rows = int(gib * 2**30) // (4 * width)
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < 2.5 * dst_rows * width * 4 + 2**30:
        pytest.skip(f"needs {2.5 * gib:.1f} GiB of free GPU memory")
    rng = np.random.default_rng(5)
    plan = random_plan(rng, dst_rows, dst_rows, max_frag=20_000)
    staging = cp.random.randint(0, 256, dst_rows * width, dtype=cp.uint8)
    out = cp.full(dst_rows * width, -5, cp.int32)
    widen_scatter(staging, plan, width, out, fill=3)
    want = cp.full(dst_rows * width, -5, cp.int32)
    for s, d, r in plan.tolist():
        dst = slice(d * width, (d + r) * width)
        want[dst] = 3 if s < 0 else staging[s * width:(s + r) * width]
    assert bool(cp.array_equal(out, want))


@needs_cupy
def test_cupy_kernel_on_a_given_stream_and_validation():
    import cupy as cp

    staging, plan, fill, want = _case(3, "uint16", 7, 500, 900, 60)
    out = cp.asarray(poisoned_out("uint16", want.size))
    stream = cp.cuda.Stream(non_blocking=True)
    widen_scatter(cp.asarray(staging), plan, 7, out, fill, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(out.get(), want)
    with pytest.raises(PlanError, match="plan row 0 .* writes past"):
        widen_scatter(cp.asarray(staging), [[0, 899, 2]], 7, out)
    with pytest.raises(PlanError, match="widens into int32"):
        widen_scatter(cp.asarray(staging), plan, 7, out.view(cp.float32))


def _torch_tensor(torch, host, device):
    if host.dtype == np.uint16:  # torch.from_numpy knows no uint16 on older releases
        return torch.from_numpy(host.view(np.int16)).to(device).view(torch.uint16)
    return torch.from_numpy(host).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cuda_tensors_through_dispatch(dtype):
    torch = _torch_cuda()
    staging, plan, fill, want = _case(11, dtype, 384, 300, 700, 90)
    out = _torch_tensor(torch, poisoned_out(dtype, want.size), "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = widen_scatter(_torch_tensor(torch, staging, "cuda"), plan, 384, out, fill)
    side.synchronize()
    assert got is out
    np.testing.assert_array_equal(bits(out.cpu().numpy()), bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 384])
def test_torch_fallback_on_cuda(dtype, width):
    torch = _torch_cuda()
    from gputq.kernels.torch_backend import torch_widen_scatter

    staging, plan, fill, want = _case(width, dtype, width, 400, 1000, 70)
    out = _torch_tensor(torch, poisoned_out(dtype, want.size), "cuda")
    torch_widen_scatter(_torch_tensor(torch, staging, "cuda"), plan, width, out, fill)
    assert out.dtype == getattr(torch, out_dtype(dtype).name)
    np.testing.assert_array_equal(bits(out.cpu().numpy()), bits(want))


@needs_cupy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("steps", [1, 2, 8])
def test_cupy_kernel_other_steps_per_thread(dtype, steps):
    import cupy as cp

    from gputq.kernels.cupy_backend import cupy_widen_scatter

    staging, plan, fill, want = _case(steps * 13, dtype, 24, 3000, 5000, max_frag=900)
    for s_shift, d_shift in ((0, 0), (5, 1)):
        out = _shifted(cp, poisoned_out(dtype, want.size), d_shift)
        cupy_widen_scatter(_shifted(cp, staging, s_shift), plan, 24, out, fill, steps=steps)
        np.testing.assert_array_equal(bits(out.get()), bits(want), err_msg=f"shifts {s_shift, d_shift}")


@needs_cupy
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_copy_from_mapped_host_memory(dtype):
    """The kernel reads compact elements straight from registered, mapped host memory."""
    import cupy as cp

    from gputq.kernels.cupy_backend import widen_scatter_from_pointer
    from gputq.transport.cuda import (
        HOST_REGISTER_MAPPED,
        HOST_REGISTER_PORTABLE,
        host_register,
        host_unregister,
        mapped_device_pointer,
    )

    width = 384
    staging, plan, fill, want = _case(77, dtype, width, 700, 1500, max_frag=200)
    page = 4096
    size = -(-(staging.nbytes + 16) // page) * page  # whole pages, with room to misalign
    raw = np.zeros(size + page, np.uint8)
    start = (-raw.ctypes.data) % page
    host = raw[start:start + size]
    host_register(host.ctypes.data, host.nbytes, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
    try:
        base = mapped_device_pointer(host.ctypes.data)
        for shift in (0, 1, 3):
            offset = shift * staging.itemsize
            host[offset:offset + staging.nbytes] = staging.view(np.uint8)
            elems = plan.copy()
            copy = elems[:, 0] >= 0
            elems[:, 0] = np.where(copy, elems[:, 0] * width, -1)
            elems[:, 1] *= width
            elems[:, 2] *= width
            out = cp.asarray(poisoned_out(dtype, want.size))
            widen_scatter_from_pointer(base + offset, dtype, staging.size, elems, out, fill)
            cp.cuda.get_current_stream().synchronize()
            np.testing.assert_array_equal(bits(out.get()), bits(want), err_msg=f"shift {shift}")
        with pytest.raises(PlanError, match="reads past"):
            widen_scatter_from_pointer(base, dtype, 10, [[0, 0, 11]], out)
    finally:
        host_unregister(host.ctypes.data)


@needs_cupy
def test_table_buffers_are_reused_across_launches():
    import cupy as cp

    from gputq.kernels import cupy_backend

    staging, plan, fill, want = _case(4, "uint8", 8, 400, 800, 30)
    stg = cp.asarray(staging)
    for _ in range(3 * cupy_backend.TABLE_SLOTS):
        out = cp.asarray(poisoned_out("uint8", want.size))
        widen_scatter(stg, plan, 8, out, fill)
    ring = cupy_backend._rings[stg.device.id]
    assert all(slot is not None for slot in ring._slots)
    np.testing.assert_array_equal(out.get(), want)
