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
    """A CuPy stand-in whose device memory is host memory, installed as ``cupy`` (see tests/host_cuda.py)."""
    from tests.host_cuda import installed

    with installed(monkeypatch, tmp_path_factory) as fake:
        yield fake
