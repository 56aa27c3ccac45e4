"""The CuPy backend's launches replayed on the host, through the kernel source compiled for the CPU.

A stand-in for CuPy (``tests/host_cuda.py``) queues copies and launches on
their streams until something forces them, and runs each launch of its
``RawModule`` through the harness of ``test_kernel_on_host``
(``widen_scatter.cu`` built with a host C++ compiler, every block and thread
in turn). Everything the backend does on the host then runs as on a GPU:
the fragment table built into a pinned upload slot and copied to the
device before the launch, the slots rotating with their events while
earlier launches still wait to run, the grid, and the arguments in the
kernel's order and C types (a Python int passed for an ``int`` parameter
would be read as 8 bytes on a GPU). The zero-copy restore goes through
:func:`gputq.kernels.cupy_backend.widen_scatter_from_pointer` on blobs
scattered in mapped host memory, read through their device addresses, as
it reads an arena mapping.
"""

from __future__ import annotations

import numpy as np
import pytest

from gputq.kernels import MappedSource, cupy_backend, reference_widen_scatter, widen_scatter
from gputq.kernels.cupy_backend import TABLE_SLOTS
from gputq.transport.cuda import HOST_REGISTER_MAPPED
from tests.kernels.test_kernel_on_host import _shifted, scattered_source
from tests.kernels.test_reference import DTYPES, bits, poisoned_out, random_plan, random_staging

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_launches_restore_bit_exact_and_reuse_their_table_slots(host_cuda, dtype):
    rng = np.random.default_rng(DTYPES.index(dtype))
    width, src_rows, dst_rows = 24, 900, 1500
    launches = TABLE_SLOTS + 2
    held, wants = [], []  # every launch queued before any runs: slots come round while their work waits
    for i in range(launches):
        staging = random_staging(rng, dtype, src_rows * width)
        # the first launch on a slot come round has more fragments than the slot holds: it grows
        plan = random_plan(rng, src_rows, dst_rows, max_frag=1 if i == TABLE_SLOTS else 40)
        source = host_cuda.device_array(_shifted(staging, i % 3))
        out = host_cuda.device_array(_shifted(poisoned_out(dtype, dst_rows * width), i % 4))
        widen_scatter(source, plan, width, out, fill=7)
        held.append((source, out))
        wants.append(reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 7))
    host_cuda.cuda.get_current_stream().synchronize()
    for i, ((_, out), want) in enumerate(zip(held, wants)):
        np.testing.assert_array_equal(bits(out.host), bits(want), err_msg=f"launch {i}")
    events = [entry for entry in host_cuda.log if entry[0] in ("copy", "launch", "record", "wait")]
    # Per launch: the table uploaded, then the launch reading it, then the slot's event; on the same stream.
    calls = [entry for entry in events if entry[0] != "wait"]
    assert [c[0] for c in calls] == ["copy", "launch", "record"] * launches
    for upload, launch, record in zip(calls[::3], calls[1::3], calls[2::3]):
        assert upload[1] == launch[1] and upload[4] == launch[2] == record[1]
    # A slot is waited on only when it comes round again; the grown one uploads elsewhere.
    assert sum(entry[0] == "wait" for entry in events) == launches - TABLE_SLOTS
    tables = [upload[1] for upload in calls[::3]]
    assert tables[TABLE_SLOTS] != tables[0] and tables[TABLE_SLOTS + 1] == tables[1]


@pytest.mark.parametrize("steps", [1, 8])
def test_launches_with_other_steps_use_a_module_built_for_them(host_cuda, steps):
    rng = np.random.default_rng(steps)
    staging = random_staging(rng, "uint8", 5_000 * 16)
    plan = random_plan(rng, 5_000, 7_000, max_frag=300)
    out = host_cuda.device_array(poisoned_out("uint8", 7_000 * 16))
    source = host_cuda.device_array(staging)
    cupy_backend.cupy_widen_scatter(source, plan, 16, out, fill=3, steps=steps)
    want = reference_widen_scatter(staging, plan, 16, poisoned_out("uint8", 7_000 * 16), 3)
    np.testing.assert_array_equal(host_cuda.to_host(out), want)


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_a_zero_copy_launch_reads_blobs_scattered_in_memory(host_cuda, dtype):
    """The in-place restore: a MappedSource over blobs out of order, as an arena holds them."""
    rng = np.random.default_rng(11)
    width, src_rows, dst_rows = 48, 700, 1000
    staging = random_staging(rng, dtype, src_rows * width)
    hosted, memory = scattered_source(rng, staging, width, blobs=8)
    host_cuda.cuda.runtime.hostRegister(memory.ctypes.data, memory.nbytes, HOST_REGISTER_MAPPED)
    # the kernel reads the blobs through the mapping's device addresses, not their host ones
    device_pointer = host_cuda.cuda.runtime.pointerGetAttributes(memory.ctypes.data).devicePointer
    source = MappedSource(hosted.starts, hosted.addresses + (device_pointer - memory.ctypes.data), hosted.lengths,
                          hosted.nbytes, hosted.dtype)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=1)  # a fragment never crosses a blob
    out = host_cuda.device_array(poisoned_out(dtype, dst_rows * width))
    widen_scatter(source, plan, width, out, fill=6)
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 6)
    np.testing.assert_array_equal(host_cuda.to_host(out), want)
    assert [entry[0] for entry in host_cuda.log].count("launch") == 1
    host_cuda.cuda.runtime.hostUnregister(memory.ctypes.data)
