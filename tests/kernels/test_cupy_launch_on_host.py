"""The CuPy backend's launches replayed on the host, through the kernel source compiled for the CPU.

A stand-in for CuPy keeps "device" memory in host memory, copies with
``memmove`` and runs each launch of its ``RawModule`` through the harness
of ``test_kernel_on_host`` (``widen_scatter.cu`` built with a host C++
compiler, every block and thread in turn). Everything the backend does on
the host then runs as on a GPU: the fragment table built into a pinned
upload slot and copied to the device before the launch, the slots rotating
with their events, the grid, and the arguments in the kernel's order and
C types (a Python int passed for an ``int`` parameter would be read as 8
bytes on a GPU). The zero-copy restore goes through
:func:`kernels.cupy_backend.widen_scatter_from_pointer` on blobs scattered
in memory, as it reads an arena mapping.
"""

from __future__ import annotations

import contextlib
import re
import types

import numpy as np
import pytest

from kernels import reference_widen_scatter, widen_scatter
from kernels import cupy_backend
from kernels.cupy_backend import _KERNELS, _SOURCE, TABLE_SLOTS, THREADS
from tests.kernels.test_kernel_on_host import _KINDS, _kernel, _shifted, scattered_source
from tests.kernels.test_reference import DTYPES, bits, poisoned_out, random_plan, random_staging

pytestmark = pytest.mark.timeout(120)


class _DeviceArray:
    """A CuPy-like array whose device memory is a host numpy array."""

    __module__ = "cupy._core.core"  # how kernels.widen_scatter tells CuPy arrays apart

    def __init__(self, host: np.ndarray):
        self.host = host
        self.dtype, self.size, self.nbytes = host.dtype, host.size, host.nbytes
        self.data = types.SimpleNamespace(ptr=host.ctypes.data)
        self.device = types.SimpleNamespace(id=0)
        self.flags = types.SimpleNamespace(c_contiguous=host.flags.c_contiguous)


class _Event:
    def __init__(self, log: list):
        self._log = log

    def record(self, stream) -> None:
        self._log.append(("record", stream.ptr))

    def synchronize(self) -> None:
        self._log.append(("wait",))


class _HostCupy:
    """The part of CuPy the backend uses; ``log`` lists uploads, launches and event calls in order."""

    def __init__(self, compiled):
        self.log: list = []
        self.ndarray, self.int64 = _DeviceArray, np.int64
        stream = types.SimpleNamespace(ptr=7)
        runtime = types.SimpleNamespace(memcpyHostToDevice=1, memcpyAsync=self._memcpy_async)
        self.cuda = types.SimpleNamespace(
            runtime=runtime, Device=lambda device: contextlib.nullcontext(), get_current_stream=lambda: stream,
            alloc_pinned_memory=bytearray, Event=lambda block, disable_timing: _Event(self.log))
        self.RawModule = lambda code, options: _HostModule(self.log, compiled, code, options)

    @staticmethod
    def empty(size: int, dtype) -> _DeviceArray:
        # zeroed, not garbage: a table never uploaded then reads as empty fragments, not wild offsets
        return _DeviceArray(np.zeros(size, dtype))

    def _memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        import ctypes

        assert kind == 1, "the table goes host to device"
        ctypes.memmove(dst, src, nbytes)
        self.log.append(("upload", dst, nbytes, stream))


class _HostModule:
    def __init__(self, log: list, compiled, code: str, options):
        assert code == _SOURCE.read_text()
        steps = int(re.search(r"-DWS_STEPS=(\d+)", " ".join(options)).group(1))
        assert f"-DWS_THREADS={THREADS}" in options
        self._log, self._launch = log, compiled(steps)

    def get_function(self, name: str):
        kind = _KINDS[{kernel: dtype for dtype, kernel in _KERNELS.items()}[name]]
        return lambda grid, block, args, stream=None: self._run(kind, grid, block, args, stream)

    def _run(self, kind: int, grid, block, args, stream) -> None:
        src, dst, table, nfrag, fill = args
        # The C types of widen_scatter.cu's parameters: two pointers, a table, int, int or float.
        assert block == (THREADS,) and len(grid) == 1
        assert type(src) is np.uint64 and type(dst) is np.uint64 and type(nfrag) is np.int32
        assert isinstance(table, _DeviceArray) and table.dtype == np.int64
        assert type(fill) is (np.float32 if kind == _KINDS["float32"] else np.int32)
        self._log.append(("launch", table.data.ptr, stream.ptr))
        self._launch(kind, int(src), int(dst), table.data.ptr, int(nfrag), int(grid[0]),
                     int(fill) if type(fill) is np.int32 else 0, float(fill) if type(fill) is np.float32 else 0.0)


@pytest.fixture
def host_cupy(monkeypatch, tmp_path_factory):
    fake = _HostCupy(lambda steps: _kernel(tmp_path_factory, steps))
    monkeypatch.setattr(cupy_backend, "_import_cupy", lambda: fake)
    monkeypatch.setattr(cupy_backend, "_modules", {})  # no stand-in module left for a real GPU test
    monkeypatch.setattr(cupy_backend, "_rings", {})
    return fake


@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_launches_restore_bit_exact_and_reuse_their_table_slots(host_cupy, dtype):
    rng = np.random.default_rng(DTYPES.index(dtype))
    width, src_rows, dst_rows = 24, 900, 1500
    launches = TABLE_SLOTS + 2
    for i in range(launches):
        staging = random_staging(rng, dtype, src_rows * width)
        # the first launch on a slot come round has more fragments than the slot holds: it grows
        plan = random_plan(rng, src_rows, dst_rows, max_frag=1 if i == TABLE_SLOTS else 40)
        out = _DeviceArray(_shifted(poisoned_out(dtype, dst_rows * width), i % 4))
        widen_scatter(_DeviceArray(_shifted(staging, i % 3)), plan, width, out, fill=7)
        want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 7)
        np.testing.assert_array_equal(bits(out.host), bits(want), err_msg=f"launch {i}")
    events = [entry for entry in host_cupy.log if entry[0] in ("upload", "launch", "record", "wait")]
    # Per launch: the table uploaded, then the launch reading it, then the slot's event; on the same stream.
    calls = [entry for entry in events if entry[0] != "wait"]
    assert [c[0] for c in calls] == ["upload", "launch", "record"] * launches
    for upload, launch, record in zip(calls[::3], calls[1::3], calls[2::3]):
        assert upload[1] == launch[1] and upload[3] == launch[2] == record[1]
    # A slot is waited on only when it comes round again; the grown one uploads elsewhere.
    assert sum(entry[0] == "wait" for entry in events) == launches - TABLE_SLOTS
    tables = [upload[1] for upload in calls[::3]]
    assert tables[TABLE_SLOTS] != tables[0] and tables[TABLE_SLOTS + 1] == tables[1]


@pytest.mark.parametrize("steps", [1, 8])
def test_launches_with_other_steps_use_a_module_built_for_them(host_cupy, steps):
    rng = np.random.default_rng(steps)
    staging = random_staging(rng, "uint8", 5_000 * 16)
    plan = random_plan(rng, 5_000, 7_000, max_frag=300)
    out = _DeviceArray(poisoned_out("uint8", 7_000 * 16))
    cupy_backend.cupy_widen_scatter(_DeviceArray(staging), plan, 16, out, fill=3, steps=steps)
    want = reference_widen_scatter(staging, plan, 16, poisoned_out("uint8", 7_000 * 16), 3)
    np.testing.assert_array_equal(out.host, want)


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_a_zero_copy_launch_reads_blobs_scattered_in_memory(host_cupy, dtype):
    """The in-place restore: a MappedSource over blobs out of order, as an arena holds them."""
    rng = np.random.default_rng(11)
    width, src_rows, dst_rows = 48, 700, 1000
    staging = random_staging(rng, dtype, src_rows * width)
    source, _memory = scattered_source(rng, staging, width, blobs=8)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=1)  # a fragment never crosses a blob
    out = _DeviceArray(poisoned_out(dtype, dst_rows * width))
    widen_scatter(source, plan, width, out, fill=6)
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 6)
    np.testing.assert_array_equal(out.host, want)
    assert [entry[0] for entry in host_cupy.log].count("launch") == 1
