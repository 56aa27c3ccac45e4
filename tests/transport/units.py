"""A real StorageUnit for transport tests, with the lease contract the transports are written to.

Transport tests are served by :class:`gputq.unit.storage_unit.StorageUnit` with a
small arena, so their replies are the real unit's. Where this branch's unit
predates parts of the lease contract (``incarnation``, ``generations``,
``expires=False``, ``end_lease`` answering whether the lease was still held),
:class:`ContractUnit` adds exactly those, on top of the real unit; once the
unit has them, :class:`ContractUnit` is the unit itself.
"""

from __future__ import annotations

import inspect
import secrets

from gputq.errors import StaleReadError
from gputq.unit.storage_unit import StorageUnit

__all__ = ["ContractUnit", "make_unit", "HAS_CONTRACT"]

#: True when the real unit already implements the lease contract.
HAS_CONTRACT = "generations" in inspect.signature(StorageUnit.lease).parameters


class _Contract(StorageUnit):
    """The unit plus the lease contract, for tests on a branch whose unit lacks it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.incarnation = secrets.token_hex(8)

    def _checked(self, lease_id, entries, generations, incarnation, expires):
        try:
            if incarnation is not None and incarnation != self.incarnation:
                raise StaleReadError(f"unit {self.name} restarted: reference is for incarnation "
                                     f"{incarnation}, unit is incarnation {self.incarnation}")
            for entry, expected in zip(entries, generations or ()):
                if expected and expected != entry.generation:
                    raise StaleReadError(f"unit {self.name}: key {entry.key!r} is generation "
                                         f"{entry.generation}, the reference expects {expected}")
        except StaleReadError:
            self.end_lease(lease_id)
            raise
        if not expires:
            with self._cond:
                self._lease_deadlines.pop(lease_id, None)

    def lease(self, keys, generations=None, incarnation=None, *, expires=True):
        lease = super().lease(keys)
        with self._cond:
            entries = list(self._leases.get(lease.lease_id, ()))
        self._checked(lease.lease_id, entries, generations, incarnation, expires)
        return lease

    def lease_regions(self, keys, generations=None, incarnation=None, *, expires=True):
        lease_id, regions = super().lease_regions(keys)
        with self._cond:
            entries = list(self._leases.get(lease_id, ()))
        self._checked(lease_id, entries, generations, incarnation, expires)
        return lease_id, regions

    def end_lease(self, lease_id):
        with self._cond:
            self._expire_leases()
            held = lease_id in self._leases
            self._end_lease(lease_id)
        return held

    def begin_write(self, key, nbytes, meta, timeout=None):
        meta = dict(meta or {})
        meta.pop("generation", None)  # the unit picks its own; receipts say which
        return super().begin_write(key, nbytes, meta, timeout)


ContractUnit = StorageUnit if HAS_CONTRACT else _Contract


def make_unit(capacity: int = 8 << 20, name: str = "su-test", **kwargs) -> StorageUnit:
    """A :data:`ContractUnit` (close it, or use it in ``with``)."""
    return ContractUnit(name, capacity, **kwargs)
