"""Test stand-in for the one-sided control methods every tcp server answers.

Every tcp server answers ``"lease"``, ``"end_lease"`` and ``"arena_file"``
in front of its handler's own control methods. Until a server does, the
:func:`answer_shm_control` fixture makes every tcp server of the test wrap
its handler in :class:`ShmControl`, which answers them the same way (as
the rdma server's lease control does for its own methods). Where the
server answers them itself, it sees the calls first and the wrapper is
never reached, so the fixture is harmless there.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

__all__ = ["ShmControl", "answer_shm_control"]


class ShmControl:
    """``handler`` with ``lease`` / ``end_lease`` / ``arena_file`` control calls added."""

    def __init__(self, handler):
        self._handler = handler
        self.name = handler.name
        lease_regions = getattr(handler, "lease_regions", None)
        if lease_regions is None:
            raise TypeError(f"{type(handler).__name__} has no lease_regions(); serve a StorageUnit")
        self._checks = "generations" in inspect.signature(lease_regions).parameters  # a unit that checks them
        self.held_override = None  # tests force an expired lease with False

    @property
    def arena(self) -> memoryview:
        return self._handler.arena

    def __getattr__(self, attr):
        return getattr(self._handler, attr)

    def control(self, method: str, args: dict) -> Any:
        h = self._handler
        if method == "lease":
            for lease_id in args.get("end") or ():
                h.end_lease(int(lease_id))
            keys = list(args["keys"])
            if self._checks:
                lease_id, regions = h.lease_regions(keys, args.get("generations"), args.get("incarnation"),
                                                    expires=True)
            else:
                lease_id, regions = h.lease_regions(keys)
            return {"lease_id": int(lease_id), "regions": np.asarray(regions, dtype="<i8").tobytes()}
        if method == "end_lease":
            return {"held": [self._end(int(i)) for i in args["lease_ids"]]}
        if method == "arena_file":
            return {"path": h.arena_path, "nbytes": h.arena.nbytes}
        return h.control(method, args)

    def _end(self, lease_id: int) -> bool:
        # A unit that predates end_lease's answer returns None: the lease was held
        # unless it is gone from its table (expired).
        leases = getattr(self._handler, "_leases", None)
        was_held = leases is None or lease_id in leases
        held = self._handler.end_lease(lease_id)
        held = was_held if held is None else bool(held)
        return held if self.held_override is None else self.held_override


@pytest.fixture
def answer_shm_control(monkeypatch):
    """Wrap the handler of every tcp server started in the test in :class:`ShmControl`.

    Yields the list of wrappers, in start order.
    """
    from transport import tcp

    wrappers: list[ShmControl] = []
    original = tcp.TcpServer.__init__

    def init(self, handler, *args, **kwargs):
        wrapper = ShmControl(handler)
        wrappers.append(wrapper)
        original(self, wrapper, *args, **kwargs)

    monkeypatch.setattr(tcp.TcpServer, "__init__", init)
    yield wrappers
