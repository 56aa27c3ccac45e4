"""A real StorageUnit for transport tests.

Transport tests are served by :class:`gputq.unit.storage_unit.StorageUnit` with a
small arena, so their replies are the real unit's. The lease contract the
transports are written to (``incarnation``, ``generations``, ``expires``,
``end_lease`` answering whether the lease was still held) is declared by
:class:`gputq.transport.handler.ArenaHandler`, which the unit implements.
"""

from __future__ import annotations

import contextlib
import threading

from gputq.unit.storage_unit import StorageUnit

__all__ = ["ContractUnit", "hung_control", "make_unit"]

#: The unit the transport tests serve (subclass it for a test double: it is an ArenaHandler).
ContractUnit = StorageUnit


def make_unit(capacity: int = 8 << 20, name: str = "su-test", **kwargs) -> StorageUnit:
    """A :data:`ContractUnit` (close it, or use it in ``with``)."""
    return ContractUnit(name, capacity, **kwargs)


@contextlib.contextmanager
def hung_control(unit: StorageUnit, methods: tuple | None = None):
    """``unit``'s control calls (stats, release, leases; only ``methods`` if given) hang until the block
    ends: a hung unit whose server still accepts connections and answers their handshakes. Yields the
    methods of the hung calls that reached it so far (a list that grows)."""
    gate, reached = threading.Event(), []
    original = unit.control

    def hung(method, args=None):
        if methods is not None and method not in methods:
            return original(method, args)
        reached.append(method)
        return gate.wait(30) and original(method, args)

    unit.control = hung
    try:
        yield reached
    finally:
        gate.set()
        unit.control = original
