"""The reader's GPU restore, run on a CPU box under a CuPy stand-in (:mod:`tests.host_cuda`).

Real StorageUnits, real sockets and arena mappings; only CuPy is replaced,
by one that queues work on streams until forced, keeps device memory in an
address space of its own and runs kernel launches through the CPU build of
``widen_scatter.cu``; the shm tests also tell it of every lease, so a
mapping read after its lease ended faults. So ``Reader(device="cuda")`` takes
every branch it takes on a GPU (device staging over tcp, the arena mapping
registered and read in place or copied over shm) and is checked bit for
bit against the inline path, as ``test_gpu_restore`` checks it on a GPU,
on device 0 and on device 1.
"""

from __future__ import annotations

import pytest

from gputq.transport.cuda import HOST_REGISTER_MAPPED, HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY
from tests.client.test_gpu_restore import restore_and_compare
from tests.host_cuda import DEVICE, HOST, UNREGISTERED

pytestmark = pytest.mark.timeout(120)

_MAPPING_FLAGS = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED | HOST_REGISTER_READ_ONLY
_UNITS = 2  # local_units' default


def _entries(log: list, kind: str) -> list:
    return [entry for entry in log if entry[0] == kind]


def _in_mapping(address: int, mappings: list) -> bool:
    return any(start <= address < start + nbytes for _, start, nbytes, _ in mappings)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "packed"])
def test_a_restore_over_tcp_stages_into_device_memory_and_launches_on_it(host_cuda, dtype):
    assert restore_and_compare("tcp", dtype) > 0
    launches = _entries(host_cuda.log, "launch")
    assert launches and {launch[5] for launch in launches} == {DEVICE}
    assert ("unpack" in {launch[7] for launch in launches}) == (dtype == "packed")
    # the staging ring's pinned slots (and the fragment tables) are copied into device memory
    copies = _entries(host_cuda.log, "copy")
    assert copies and {copy[5] for copy in copies} == {HOST}


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "copied"])
def test_a_restore_over_shm_reads_the_registered_mapping_in_place_or_copies_from_it(shm_leases_checked, zero_copy,
                                                                                    dtype):
    host_cuda = shm_leases_checked  # the mappings' bytes are read only while their leases hold
    assert restore_and_compare("shm", dtype, zero_copy_max_bytes=float("inf") if zero_copy else 0) > 0
    log = host_cuda.log
    # Each unit's arena mapping is page-locked read-only and mapped once, however many fetches read it.
    mappings = [entry for entry in _entries(log, "register") if entry[3] == _MAPPING_FLAGS]
    assert len(mappings) == _UNITS
    launches, copies = _entries(log, "launch"), _entries(log, "copy")
    assert launches
    from_mappings = [copy for copy in copies if _in_mapping(copy[2], mappings)]
    if zero_copy:
        # the kernel reads the compact bytes where they lie; only fragment tables are copied
        # (through the mappings' device addresses, which are not their host ones)
        assert all(launch[5] == HOST and _in_mapping(launch[3] - host_cuda.mapped_offset, mappings)
                   for launch in launches)
        assert not from_mappings
    else:
        # spans of the mappings are copied into device memory, and the kernel reads them there
        assert {launch[5] for launch in launches} == {DEVICE}
        assert from_mappings and {copy[5] for copy in from_mappings} == {HOST}
    # Closed: the mappings and the units' own arenas are unregistered, every one of them.
    assert sorted(entry[1] for entry in _entries(log, "register")) == \
        sorted(entry[1] for entry in _entries(log, "unregister"))


def test_packed_ids_over_shm_are_read_into_device_memory_and_unpacked_there(shm_leases_checked):
    # In place is allowed (inf), but the unpack kernel reads plain device staging only: every launch does.
    host_cuda = shm_leases_checked
    assert restore_and_compare("shm", "packed", zero_copy_max_bytes=float("inf")) > 0
    launches = _entries(host_cuda.log, "launch")
    assert {launch[5] for launch in launches} == {DEVICE} and "unpack" in {launch[7] for launch in launches}


def test_without_read_only_registration_the_restore_copies_from_pageable_memory(host_cuda):
    # A driver that cannot page-lock a read-only mapping: no zero-copy, the reads copy into device memory.
    host_cuda.read_only_register_supported = False
    assert restore_and_compare("shm", "uint16") > 0
    assert not [entry for entry in _entries(host_cuda.log, "register") if entry[3] == _MAPPING_FLAGS]
    assert {launch[5] for launch in _entries(host_cuda.log, "launch")} == {DEVICE}
    assert UNREGISTERED in {copy[5] for copy in _entries(host_cuda.log, "copy")}


def test_slime_samples_hydrate_through_the_device_path(host_cuda):
    pytest.importorskip("torch", reason="a device Reader returns torch tensors")
    from tests.integrations.test_slime import hydrate_and_compare

    hydrate_and_compare()
    assert {launch[5] for launch in _entries(host_cuda.log, "launch")} == {DEVICE}



@pytest.mark.parametrize("transport, zero_copy_max_bytes", [("tcp", 0), ("shm", float("inf")), ("shm", 0)],
                         ids=["tcp", "shm-in-place", "shm-copied"])
def test_a_reader_on_the_second_device_restores_there(shm_leases_checked, transport, zero_copy_max_bytes):
    host_cuda = shm_leases_checked
    assert restore_and_compare(transport, "uint16", device="cuda:1", zero_copy_max_bytes=zero_copy_max_bytes) > 0
    launches = _entries(host_cuda.log, "launch")
    assert launches and {launch[6] for launch in launches} == {1}


def test_a_device_reader_without_torch_says_what_to_install_before_reading(host_cuda, monkeypatch):
    """Device readers return CUDA torch tensors: without torch the Reader refuses at once, naming the package,
    instead of a bare ModuleNotFoundError at its first restore."""
    import sys

    from gputq.client.reader import Reader
    from gputq.errors import MissingDependencyError
    from tests.conftest import local_units

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with local_units("tcp", units=1) as (config, _, clients):
        with pytest.raises(MissingDependencyError, match=r"returns CUDA torch tensors: pip install torch"):
            Reader(clients, config, device="cuda")
