"""A unit's key directory: where each committed key lies, published for same-host readers.

A one-sided read needs the offsets of its keys in the arena, and those are
the unit's to tell: over the control lane that is a round trip before the
first byte moves (the ``lease`` call). A unit also publishes every committed
key's region in a small shared-memory table, the directory, that a reader
on the same host maps read-only next to the arena. The reader then starts
copying at once, from the regions the directory names, while its ``lease``
request is in flight, and checks the copy against the reply.

The directory is only ever a hint. Entries are written without locks a
reader could see, so an entry may be torn, overwritten by another key whose
hash probes the same slots, or withdrawn a moment later. What makes a copy
made ahead of the lease correct is the reply: the unit leases a key only if
it is still stored under the reference's generation, and a stored key
never moves nor changes while stored. A key stored under generation ``g``
when the lease is granted was stored, at the same offset, since before the
directory was read (a generation is drawn afresh for every write), so the
bytes copied from that offset were the key's. When the reply's regions equal
the hinted ones the copy stands; otherwise the reader copies again, after a
second lease.

Layout: ``slots`` (a power of two) entries of four little-endian int64:
the key's hash (0: empty), its generation, its arena offset, its length. A
key's entries are looked for in the :data:`PROBE` slots from ``hash &
(slots - 1)`` on.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Sequence

import numpy as np

__all__ = ["KeyDirectory", "DirectoryView", "key_hash", "directory_slots", "directory_nbytes", "PROBE"]

#: Slots a key may occupy, from its home slot on.
PROBE = 8
_WORDS = 4  # hash, generation, offset, length
_MIN_SLOTS, _MAX_SLOTS = 1 << 12, 1 << 20
#: Arena bytes per slot: one slot per 16 KiB of arena, a table of 1/512 of it.
_BYTES_PER_SLOT = 16 << 10


def key_hash(key: str) -> int:
    """A key's directory hash: the same in every process (``hash()`` is salted per process), never 0."""
    value = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
    return value or 1


def directory_slots(arena_bytes: int) -> int:
    """Slots for an arena of ``arena_bytes``: a power of two, 4096 to 2**20."""
    wanted = max(_MIN_SLOTS, min(_MAX_SLOTS, int(arena_bytes) // _BYTES_PER_SLOT))
    return 1 << (wanted - 1).bit_length()


def directory_nbytes(slots: int) -> int:
    """Bytes of a directory of ``slots`` slots."""
    return int(slots) * _WORDS * 8


def _table(buffer: np.ndarray, slots: int) -> np.ndarray:
    if slots <= 0 or slots & (slots - 1):
        raise ValueError(f"directory slots must be a power of two, got {slots}")
    if buffer.nbytes < directory_nbytes(slots):
        raise ValueError(f"a directory of {slots} slots needs {directory_nbytes(slots)} bytes, "
                         f"the buffer holds {buffer.nbytes}")
    return buffer[:directory_nbytes(slots)].view("<i8").reshape(slots, _WORDS)


class KeyDirectory:
    """The unit's side: publishes and withdraws keys. Call it under the unit's lock.

    Parameters
    ----------
    buffer : numpy.ndarray
        Writable ``uint8`` memory of :func:`directory_nbytes` bytes, shared
        with readers (the unit's directory file), zeroed.
    slots : int
        A power of two.
    """

    def __init__(self, buffer: np.ndarray, slots: int):
        self.slots = int(slots)
        self._table = _table(buffer, self.slots)
        self._mask = self.slots - 1

    def close(self) -> None:
        """Let go of the file's memory, so the unit can unmap it (and close its descriptor) now.

        A closed directory publishes and withdraws nothing: leases that end
        after their unit closed still free regions, with no one to tell.
        """
        self._table = None

    def publish(self, key: str, generation: int, offset: int, nbytes: int) -> None:
        """Name ``key``'s region: in a free slot of its probe, the slot of its hash, else its home slot."""
        if self._table is None:
            return
        h = key_hash(key)
        home = h & self._mask
        slot = home
        for step in range(PROBE):
            candidate = (home + step) & self._mask
            if self._table[candidate, 0] in (0, h):
                slot = candidate
                break
        entry = self._table[slot]
        entry[0] = 0  # a reader racing this write sees an empty slot or a torn one, never trusted blindly
        entry[1:] = (generation, offset, nbytes)
        entry[0] = h

    def withdraw(self, key: str, generation: int) -> None:
        """Drop ``key``'s entry of ``generation`` (no other), if it still has one."""
        if self._table is None:
            return
        h = key_hash(key)
        home = h & self._mask
        for step in range(PROBE):
            entry = self._table[(home + step) & self._mask]
            if entry[0] == h and entry[1] == generation:
                entry[0] = 0
                return


class DirectoryView:
    """A reader's view of a unit's directory, read-only.

    Parameters
    ----------
    buffer : numpy.ndarray
        The directory file mapped read-only, as ``uint8``.
    slots : int
        The unit's slot count (the ``arena_file`` control call says it).
    """

    def __init__(self, buffer: np.ndarray, slots: int):
        if sys.byteorder != "little":  # the table is little-endian; read natively below
            raise ValueError("key directories are read on little-endian hosts only")
        self.slots = int(slots)
        self._words = memoryview(_table(buffer, self.slots)).cast("B").cast("q")

    def lookup(self, keys: Sequence[str], generations: Sequence[int], *,
               within: int | None = None) -> np.ndarray | None:
        """The published regions (int64 ``[n, 2]`` of offset, length) of ``keys`` at ``generations``.

        ``None`` unless every key has an entry of its generation (a
        generation of 0, unknown, never has one) and, with ``within``,
        every region lies inside ``[0, within)`` (a torn or foreign entry
        may name any bytes). The regions are hints: see the module's note.
        """
        if len(keys) != len(generations) or not len(keys):
            return None
        # A plain loop over the mapping: a read looks up a few keys per unit, and a dozen
        # numpy calls cost more than the probes, the more so in caches a copy just swept.
        words, mask, found = self._words, self.slots - 1, []
        for key, generation in zip(keys, generations):
            if not generation:
                return None
            h = key_hash(key)
            for step in range(PROBE):
                at = ((h + step) & mask) * _WORDS
                if words[at] == h and words[at + 1] == generation:
                    offset, nbytes = words[at + 2], words[at + 3]
                    if offset < 0 or nbytes < 0 or (within is not None and offset + nbytes > within):
                        return None  # Python ints: the sum cannot overflow
                    found += (offset, nbytes)
                    break
            else:
                return None
        return np.array(found, np.int64).reshape(-1, 2)
