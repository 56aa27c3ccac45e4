"""Deterministic key placement by rendezvous (highest-random-weight) hashing.

Every writer computes the same unit for a key from the membership alone, so
placing a key needs no controller call; removing a unit moves only its keys.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

from gputq.errors import InvalidInputError

__all__ = ["rendezvous_unit", "rendezvous_order"]


def _weight(key: str, unit: str) -> int:
    digest = hashlib.blake2b(f"{unit}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rendezvous_order(key: str, units: Iterable[str]) -> list[str]:
    """All units ordered by preference for ``key`` (first is the owner)."""
    return sorted(units, key=lambda unit: _weight(key, unit), reverse=True)


def rendezvous_unit(key: str, units: Sequence[str]) -> str:
    """The unit that stores ``key``."""
    if not units:
        raise InvalidInputError("no StorageUnits to place keys on")
    return max(units, key=lambda unit: _weight(key, unit))
