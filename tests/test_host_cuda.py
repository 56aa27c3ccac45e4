"""The CuPy stand-in (``tests/host_cuda.py``) fails when the GPU code it stands under is wrong.

Two kinds of checks. The stand-in's own promises, one test each: queued work
waits until forced, pinned host memory is read when a copy runs, device and
host addresses differ, launches check their extents, freed memory faults, a
copy of leased memory that runs once its lease ended faults (unless leases
held then cover its bytes, or bytes on both sides of them), registrations
are enforced, two devices exist. And :data:`MUTATIONS`: each
entry breaks one synchronisation (or one address, or one length) of the real
code; :func:`test_a_mutation_fails_a_stand_in_test` applies it to the module,
through an import hook in a fresh interpreter, and runs the stand-in tests
the entry names, of which at least one must fail. Every wait, event and
stream ordering of the GPU path has an entry; one that no stand-in test
caught would be a sync nothing needs, to be removed with its reason.

An entry finds its code by a short piece of text that must occur exactly
once in the module (:func:`test_every_mutation_finds_its_code_once`): code
rewritten elsewhere fails that test by the entry's name, and the entry is
moved to the new code.

What the stand-in still cannot show: timing (how long anything takes, or
whether copies overlap receives), real concurrency inside a kernel (the
threads of a launch run one after the other, so races between them never
show), and alignment faults (the CPU loads misaligned vectors that a GPU
refuses). ``bench/gpu_check.sh`` checks these on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)

_ROOT = Path(__file__).resolve().parents[1]
_RESTORE = "tests/client/test_gpu_restore_on_host.py"
_TCP_RESTORE = f"{_RESTORE}::test_a_restore_over_tcp_stages_into_device_memory_and_launches_on_it[uint16]"
_IN_PLACE = f"{_RESTORE}::test_a_restore_over_shm_reads_the_registered_mapping_in_place_or_copies_from_it[in-place-uint16]"
_COPIED = f"{_RESTORE}::test_a_restore_over_shm_reads_the_registered_mapping_in_place_or_copies_from_it[copied-uint16]"
_SECOND_DEVICE = f"{_RESTORE}::test_a_reader_on_the_second_device_restores_there[shm-in-place]"
_STAGING = "tests/transport/test_staging_on_host.py"
_LAUNCHES = "tests/kernels/test_cupy_launch_on_host.py::test_cupy_launches_restore_bit_exact_and_reuse_their_table_slots[uint8]"
_SHM_GPU_READ = "tests/transport/test_shm.py::test_a_read_into_gpu_memory_copies_each_run_from_the_mapping"


@dataclass(frozen=True)
class Mutation:
    """``code`` replaced by ``mutant`` in ``path``; one of ``tests`` must then fail."""

    name: str
    path: str
    code: str
    mutant: str
    tests: tuple[str, ...]
    fast: bool = False  # also run by `make test` (the others are slow)

    @property
    def module(self) -> str:
        dotted = self.path.removesuffix(".py").replace("/", ".")
        return dotted if dotted.startswith("gputq.") else f"gputq.{dotted}"  # transport/, kernels/


MUTATIONS = (
    Mutation("the reader returns tensors and ends leases without waiting for its kernels",
             "gputq/client/read_context.py", "cp.cuda.get_current_stream().synchronize()", "None",
             (_TCP_RESTORE,)),
    Mutation("the reader ends an in-place restore's leases before the device read the mappings",
             "gputq/client/in_place.py", "leases = lent if in_place else copied", "leases = copied",
             (_IN_PLACE,), fast=True),
    Mutation("a cuda:1 restore waits on device 0's stream",
             "gputq/client/read_context.py", "cp.cuda.Device(device_index(self.device)):  # the kernels ran",
             "cp.cuda.Device(0):  # the kernels ran",
             (f"{_RESTORE}::test_a_reader_on_the_second_device_restores_there[tcp]",)),
    Mutation("a staging slot is refilled without waiting for its last copy",
             "transport/staging.py", "                copier.wait(slot)\n", "                pass\n",
             (_STAGING,)),
    Mutation("a staging slot is reused without its event (the copy records none)",
             "transport/staging.py", "            event.record(self._stream)\n            self._events[slot] = event\n"
             "\n    def synchronize(self) -> None:\n        self._stream.synchronize()\n\n\nclass _TorchCopier",
             "            self._events[slot] = event\n"
             "\n    def synchronize(self) -> None:\n        self._stream.synchronize()\n\n\nclass _TorchCopier",
             (_STAGING,)),
    Mutation("a tcp receive returns before its copies ran",
             "transport/staging.py", "            copier.synchronize()\n", "            pass\n",
             (_STAGING,)),
    Mutation("the staging copies do not wait for work already queued on their destination",
             "transport/staging.py", "self._stream.wait_event(self._cp.cuda.get_current_stream().record())", "None",
             (_STAGING,)),
    Mutation("a zero-copy restore lends the mapping's host address where the device address belongs",
             "transport/shm.py", "base = mapped_device_pointer(self.mapping.address)", "base = self.mapping.address",
             (_IN_PLACE,), fast=True),
    Mutation("a copy out of the mapping into the device is cut short by 4 bytes",
             "transport/arena_copies.py", "rt.memcpyAsync(dst + off, src_base + src, n,",
             "rt.memcpyAsync(dst + off, src_base + src, n - 4,", (_SHM_GPU_READ, _COPIED)),
    Mutation("a device read out of the mapping returns (and its lease ends) before its copies ran",
             "transport/arena_copies.py", "stream.synchronize()  # the lease must cover the copy", "None",
             (_SHM_GPU_READ,)),
    Mutation("a kernel is launched before its fragment table's upload",
             "kernels/cupy_backend.py",
             "            cp.cuda.runtime.memcpyAsync(slot[2].data.ptr, slot[1].ctypes.data, table.nbytes,\n"
             "                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)\n"
             "            kernel((nblocks,), (THREADS,), (*args[:2], slot[2], np.int32(len(plan)), *args[2:]), "
             "stream=stream)\n",
             "            kernel((nblocks,), (THREADS,), (*args[:2], slot[2], np.int32(len(plan)), *args[2:]), "
             "stream=stream)\n"
             "            cp.cuda.runtime.memcpyAsync(slot[2].data.ptr, slot[1].ctypes.data, table.nbytes,\n"
             "                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)\n",
             (_LAUNCHES,)),
    Mutation("a fragment table slot is refilled without waiting for the kernel that read it",
             "kernels/cupy_backend.py", "                slot[3].synchronize()\n", "                pass\n",
             (_LAUNCHES,)),
    Mutation("a fragment table slot is reused without its event (the launch records none)",
             "kernels/cupy_backend.py", "            slot[3].record(stream)\n", "            pass\n", (_LAUNCHES,)),
    Mutation("a launch for cuda:1 runs on device 0",
             "kernels/cupy_backend.py", "    with cp.cuda.Device(device_id):\n        stream = stream",
             "    with cp.cuda.Device(0):\n        stream = stream", (_SECOND_DEVICE,)),
)

# Run in a fresh interpreter: the entry's module is compiled from the mutated text (under its
# own file name, so tracebacks and __file__ point at it), the rest imports as installed.
_CHILD = r"""
import importlib.abc, importlib.util, sys

name, path, code, mutant = sys.argv[1:5]
with open(path) as f:
    source = f.read().replace(code, mutant)


class Mutant(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, target_path=None, target=None):
        return importlib.util.spec_from_file_location(name, path, loader=self) if fullname == name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(compile(source, path, "exec"), module.__dict__)


sys.meta_path.insert(0, Mutant())
import numpy as np
import pytest

sys.exit(pytest.main(sys.argv[5:]))
"""


def _run_mutated(mutation: Mutation, mutant: str, tests, *options: str) -> subprocess.CompletedProcess:
    """Run ``tests`` in a fresh interpreter with ``mutation``'s code replaced by ``mutant``."""
    return subprocess.run(
        [sys.executable, "-c", _CHILD, mutation.module, str(_ROOT / mutation.path), mutation.code, mutant,
         *options, "-q", "-p", "no:cacheprovider", "--timeout=90", *tests],
        cwd=_ROOT, capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def _source(mutation: Mutation) -> str:
    path = _ROOT / mutation.path
    if not path.exists():
        pytest.fail(f"mutation {mutation.name!r}: {mutation.path} no longer exists; move the entry to the code")
    return path.read_text()


def _finds_its_code_once(mutation: Mutation) -> None:
    found = _source(mutation).count(mutation.code)
    assert found == 1, (f"mutation {mutation.name!r}: its code occurs {found} times in {mutation.path} "
                        f"(once expected); retarget the entry at the code as it reads now:\n{mutation.code}")


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_finds_its_code_once(mutation):
    _finds_its_code_once(mutation)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mutation", [m if m.fast else pytest.param(m, marks=pytest.mark.slow) for m in MUTATIONS],
                         ids=lambda m: m.name)
def test_a_mutation_fails_a_stand_in_test(mutation):
    _finds_its_code_once(mutation)
    child = _run_mutated(mutation, mutation.mutant, mutation.tests, "-x")
    tail = (child.stdout + child.stderr)[-3000:]
    ran = (child.stdout.strip().splitlines() or [""])[-1]
    if child.returncode == 0 and " passed" not in ran and importlib.util.find_spec("torch") is None:
        pytest.skip(f"mutation {mutation.name!r}: the tests it names need torch (make test installs it): {ran}")
    assert child.returncode != 0, f"mutation {mutation.name!r} survived: {' '.join(mutation.tests)} all passed"
    assert child.returncode == 1, f"mutation {mutation.name!r}: pytest could not run the tests:\n{tail}"
    # which test caught it, and how (shown with -rA)
    print("\n".join(line for line in child.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E "))))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_unmutated_code_passes_every_test_the_table_names():
    # The hook itself changes nothing: a failure above is the mutation's, not the harness's.
    tests = sorted({test for mutation in MUTATIONS for test in mutation.tests})
    child = _run_mutated(MUTATIONS[0], MUTATIONS[0].code, tests)
    assert child.returncode == 0, (child.stdout + child.stderr)[-3000:]


# -- the stand-in's own promises -------------------------------------------------------------------

def _pinned(cupy, values: np.ndarray):
    memory = cupy.cuda.alloc_pinned_memory(values.nbytes)
    np.frombuffer(memory, values.dtype)[:] = values
    return memory


def _copy(cupy, dst, src_ptr: int, nbytes: int, stream) -> None:
    cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src_ptr, nbytes, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)


def test_queued_work_runs_when_forced_and_reads_pinned_memory_then(host_cuda):
    dest = host_cuda.empty(64, np.uint8)
    pinned, stream = _pinned(host_cuda, np.full(64, 1, np.uint8)), host_cuda.cuda.Stream()
    _copy(host_cuda, dest, pinned.ptr, 64, stream)
    assert (host_cuda.to_host(dest) == 0xA5).all()  # this thread's stream orders with nothing of `stream`
    np.frombuffer(pinned, np.uint8)[:] = 2  # refilled before the copy ran: the copy reads this
    stream.synchronize()
    assert (host_cuda.to_host(dest) == 2).all()


def test_pageable_memory_is_read_at_the_call(host_cuda):
    dest, pageable = host_cuda.empty(64, np.uint8), np.full(64, 3, np.uint8)
    stream = host_cuda.cuda.Stream()
    _copy(host_cuda, dest, pageable.ctypes.data, 64, stream)
    pageable[:] = 4
    stream.synchronize()
    assert (host_cuda.to_host(dest) == 3).all()


def test_an_event_orders_two_streams_and_the_device_sync_takes_the_order_chosen(host_cuda):
    dest = host_cuda.empty(64, np.uint8)
    first, second = _pinned(host_cuda, np.full(64, 5, np.uint8)), _pinned(host_cuda, np.full(64, 6, np.uint8))
    a, b = host_cuda.cuda.Stream(), host_cuda.cuda.Stream()
    _copy(host_cuda, dest, first.ptr, 64, a)
    b.wait_event(a.record())
    _copy(host_cuda, dest, second.ptr, 64, b)
    b.synchronize()  # runs a's copy first: b waits for it
    assert (host_cuda.to_host(dest) == 6).all()
    for schedule, last in (("fifo", 6), ("reverse", 5)):  # unordered streams: whichever runs last wins
        host_cuda.schedule = schedule
        _copy(host_cuda, dest, first.ptr, 64, a)
        _copy(host_cuda, dest, second.ptr, 64, b)
        host_cuda.synchronize()
        assert (host_cuda.to_host(dest) == last).all(), schedule


def test_device_memory_has_addresses_of_its_own(host_cuda):
    from tests.host_cuda import DEVICE, DEVICE_BASE, UNREGISTERED

    array = host_cuda.empty(16, np.uint8)
    assert array.data.ptr >= DEVICE_BASE and host_cuda.memory_type(array.data.ptr, 16) == DEVICE
    assert host_cuda.memory_type(array.host.ctypes.data) == UNREGISTERED


def _launch_from(host_cuda, src_ptr: int, src_elems: int, out, plan):
    from gputq.kernels.cupy_backend import widen_scatter_from_pointer

    widen_scatter_from_pointer(src_ptr, "uint8", src_elems, np.asarray(plan, np.int64), out)
    host_cuda.cuda.get_current_stream().synchronize()


def test_a_kernel_reads_host_memory_only_through_a_mapped_registration(host_cuda):
    from tests.host_cuda import CUDARuntimeError

    memory, out = np.arange(256, dtype=np.uint8), host_cuda.empty(256, np.int32)
    runtime = host_cuda.cuda.runtime
    runtime.hostRegister(memory.ctypes.data, memory.nbytes, 0)  # page-locked, not mapped
    assert runtime.pointerGetAttributes(memory.ctypes.data).devicePointer == 0
    with pytest.raises(CUDARuntimeError, match="only through a mapped registration"):
        _launch_from(host_cuda, memory.ctypes.data, 256, out, [[0, 0, 256]])
    runtime.hostUnregister(memory.ctypes.data)
    runtime.hostRegister(memory.ctypes.data, memory.nbytes, 0x02)  # mapped
    device_pointer = runtime.pointerGetAttributes(memory.ctypes.data).devicePointer
    assert device_pointer != memory.ctypes.data
    _launch_from(host_cuda, device_pointer, 256, out, [[0, 0, 256]])
    assert np.array_equal(host_cuda.to_host(out), np.arange(256))
    runtime.hostUnregister(memory.ctypes.data)


def test_a_launch_checks_every_fragment_against_its_memory(host_cuda):
    from tests.host_cuda import CUDARuntimeError

    source, out = host_cuda.empty(100, np.uint8), host_cuda.empty(300, np.int32)
    # src_elems claims more than the allocation holds: the plan passes, the device faults
    with pytest.raises(CUDARuntimeError, match="4 bytes past an allocation of 100"):
        _launch_from(host_cuda, source.data.ptr, 300, out, [[0, 0, 10], [90, 10, 14]])


def test_freed_device_memory_faults_when_queued_work_reaches_it(host_cuda):
    import gc

    from tests.host_cuda import CUDARuntimeError

    dest, stream = host_cuda.empty(64, np.uint8), host_cuda.cuda.Stream()
    pinned = _pinned(host_cuda, np.zeros(64, np.uint8))
    _copy(host_cuda, dest, pinned.ptr, 64, stream)
    del dest
    gc.collect()
    with pytest.raises(CUDARuntimeError, match="freed device memory"):
        stream.synchronize()


def test_a_copy_that_runs_after_its_lease_ended_faults_unless_leases_held_then_cover_or_bridge_its_bytes(host_cuda):
    from tests.host_cuda import CUDARuntimeError

    dest, stream = host_cuda.empty(64, np.uint8), host_cuda.cuda.Stream()
    pinned = _pinned(host_cuda, np.full(64, 7, np.uint8))
    host_cuda.lease_started(pinned.ptr, 16)  # a span of a key, read and done with
    host_cuda.lease_ended(pinned.ptr, 16)
    host_cuda.lease_started(pinned.ptr + 8, 56)  # other spans of it, leased again
    _copy(host_cuda, dest, pinned.ptr + 8, 56, stream)
    stream.synchronize()
    assert (host_cuda.to_host(dest)[:56] == 7).all()
    _copy(host_cuda, dest, pinned.ptr, 64, stream)  # bytes 0..7: only under the lease that ended
    with pytest.raises(CUDARuntimeError, match="after its lease ended"):
        stream.synchronize()
    host_cuda.lease_started(pinned.ptr + 48, 16)
    host_cuda.lease_ended(pinned.ptr + 8, 56)  # bytes 16..47 lie between two leases held
    host_cuda.lease_started(pinned.ptr, 16)
    _copy(host_cuda, dest, pinned.ptr, 64, stream)  # one span over both, bridging the gap
    stream.synchronize()
    _copy(host_cuda, dest, pinned.ptr, 64, stream)
    host_cuda.lease_ended(pinned.ptr + 48, 16)  # before the copy ran: bytes 48..63 under no lease
    with pytest.raises(CUDARuntimeError, match="after its lease ended"):
        stream.synchronize()


def test_registrations_are_enforced_and_leaks_reported(host_cuda):
    from tests.host_cuda import CUDARuntimeError

    memory, runtime = np.zeros(4096, np.uint8), host_cuda.cuda.runtime
    with pytest.raises(CUDARuntimeError, match="NotRegistered"):
        runtime.hostUnregister(memory.ctypes.data)
    runtime.hostRegister(memory.ctypes.data, 4096, 0x02 | 0x08)  # mapped, read-only
    with pytest.raises(CUDARuntimeError, match="AlreadyRegistered"):
        runtime.hostRegister(memory.ctypes.data + 1024, 1024, 0)
    device_pointer = runtime.pointerGetAttributes(memory.ctypes.data).devicePointer
    with pytest.raises(CUDARuntimeError, match="writes through a read-only registration"):
        runtime.memcpyAsync(device_pointer, memory.ctypes.data, 16, runtime.memcpyHostToDevice,
                            host_cuda.cuda.get_current_stream().ptr)
    with pytest.raises(AssertionError, match="still registered with CUDA when the stand-in was removed: 4096 bytes"):
        host_cuda.close()
    runtime.hostUnregister(memory.ctypes.data)


def test_two_devices_and_tensors_that_say_which(host_cuda):
    torch = pytest.importorskip("torch", reason="the stand-in's tensors are torch's: make test installs torch")

    from tests.host_cuda import CUDARuntimeError

    with host_cuda.cuda.Device(1):
        array = host_cuda.empty(8, np.int32)
        other = host_cuda.cuda.Stream()
    assert array.device.id == 1 and host_cuda.cuda.runtime.pointerGetAttributes(array.data.ptr).device == 1
    tensor = torch.from_dlpack(array)
    assert tensor.is_cuda and tensor.device == torch.device("cuda:1") and tensor[2:].device == torch.device("cuda:1")
    with pytest.raises(TypeError, match="cuda:1 device type tensor to numpy"):
        tensor.numpy()
    with pytest.raises(CUDARuntimeError, match="InvalidDevice"):
        host_cuda.cuda.Device(2)
    out = host_cuda.empty(8, np.int32)  # on device 0: a launch there on device 1's stream is refused
    from gputq.kernels.cupy_backend import widen_scatter_from_pointer

    with pytest.raises(CUDARuntimeError, match="stream of device 1"):
        widen_scatter_from_pointer(array.data.ptr, "int32", 8, np.array([[0, 0, 8]]), out, stream=other)
