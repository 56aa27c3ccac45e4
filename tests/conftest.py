"""Shared fixtures: in-process StorageUnits served over a real transport."""

from __future__ import annotations

import pytest

from gputq.cluster.deploy import local_cluster
from gputq.config import GputqConfig


def nixl_usable() -> str | None:
    """None when a NIXL agent can be created here, else the reason it cannot."""
    from gputq.transport.policy import nixl_import_error

    error = nixl_import_error()
    return None if error is None else f"NIXL not importable: {error}"


TRANSPORT_PARAMS = [
    "tcp",
    "shm",
    pytest.param("rdma", marks=[pytest.mark.rdma,
                                pytest.mark.skipif(nixl_usable() is not None, reason=str(nixl_usable()))]),
]


def local_units(transport: str = "tcp", *, units: int = 2, capacity: int = 64 << 20, **overrides):
    """``units`` in-process StorageUnits over ``transport`` and clients to them."""
    return local_cluster(GputqConfig(enabled=True, use_rollout_routing_replay=True, transport=transport,
                                     num_units=units, unit_capacity_bytes=capacity, host="127.0.0.1",
                                     **overrides))


@pytest.fixture(params=TRANSPORT_PARAMS)
def transport_name(request):
    return request.param


@pytest.fixture
def host_cuda(monkeypatch, tmp_path_factory):
    """A CuPy stand-in that behaves like a GPU where bugs show, installed as ``cupy`` (see tests/host_cuda.py)."""
    from tests.host_cuda import installed

    with installed(monkeypatch, tmp_path_factory) as fake:
        yield fake


@pytest.fixture
def shm_leases_checked(host_cuda, monkeypatch):
    """``host_cuda`` told of every shm lease: queued work that reads a mapping after its lease ended faults.

    A unit may reuse a region once its lease ended; the stand-in cannot race a real reuse, so it
    refuses any read of the region from then on instead.
    """
    import contextlib

    from gputq.transport.shm import ShmChannel

    leased = ShmChannel._leased

    @contextlib.contextmanager
    def declared(channel, *args, **kwargs):
        held = []
        try:
            with leased(channel, *args, **kwargs) as regions:
                for offset, length in regions.tolist():
                    if length:
                        host_cuda.lease_started(channel.mapping.address + offset, length)
                        held.append((channel.mapping.address + offset, length))
                yield regions
        finally:  # after the lease was confirmed (or failed): ended either way
            for address, length in held:
                host_cuda.lease_ended(address, length)

    monkeypatch.setattr(ShmChannel, "_leased", declared)
    return host_cuda
