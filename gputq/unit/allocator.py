"""A best-fit free-list allocator over one contiguous byte range (an arena).

The allocator only does bookkeeping: it hands out offsets and never touches
memory. Every offset and every block size is a multiple of ``alignment``,
so free blocks stay aligned and neighbours can always be coalesced.

Free blocks are indexed twice: by offset (to find neighbours when a block
is freed) and by ``(size, offset)`` (to find the smallest block that fits).
Both indexes are sorted lists searched with :mod:`bisect`, so lookups are
O(log n) and updates cost one small ``memmove``.

A zero-byte allocation takes one alignment unit. That gives it a distinct
offset that ``free`` can identify like any other, and it keeps a flood of
empty keys bounded by the same capacity that bounds everything else.
"""

from __future__ import annotations

import bisect

from gputq.errors import InvalidInputError

__all__ = ["FreeListAllocator"]


class FreeListAllocator:
    """Best-fit allocator with coalescing over ``[0, capacity)``.

    Not thread-safe: the owner (the StorageUnit) serialises calls.

    Parameters
    ----------
    capacity : int
        Size of the managed range in bytes. A tail shorter than
        ``alignment`` is never handed out.
    alignment : int, optional
        Power of two every offset and block size is a multiple of.
    """

    def __init__(self, capacity: int, alignment: int = 256):
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidInputError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise InvalidInputError(f"capacity must be >= 0, got {capacity}")
        self._alignment = alignment
        self._capacity = capacity - capacity % alignment
        self._free_offsets: list[int] = []
        self._free_by_size: list[tuple[int, int]] = []
        self._free_size: dict[int, int] = {}
        self._used: dict[int, int] = {}
        self._used_bytes = 0
        if self._capacity:
            self._add_free(0, self._capacity)

    # -- queries --------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Usable bytes (the constructor's capacity rounded down to alignment)."""
        return self._capacity

    @property
    def alignment(self) -> int:
        """Granularity of offsets and block sizes."""
        return self._alignment

    @property
    def used_bytes(self) -> int:
        """Bytes in live blocks, counting alignment padding."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes not in any live block."""
        return self._capacity - self._used_bytes

    @property
    def largest_free(self) -> int:
        """Size of the largest free block: the largest request that fits now."""
        return self._free_by_size[-1][0] if self._free_by_size else 0

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free / free_bytes``: 0 when free space is one block."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    @property
    def num_free_blocks(self) -> int:
        """Number of free blocks (1 when nothing is fragmented)."""
        return len(self._free_offsets)

    @property
    def num_allocations(self) -> int:
        """Number of live blocks."""
        return len(self._used)

    def block_size(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` occupies (rounded up, at least one unit)."""
        if nbytes < 0:
            raise InvalidInputError(f"nbytes must be >= 0, got {nbytes}")
        a = self._alignment
        return max(a, (nbytes + a - 1) // a * a)

    def fits_ever(self, nbytes: int) -> bool:
        """True if ``nbytes`` fits into the empty range."""
        return self.block_size(nbytes) <= self._capacity

    def size_of(self, offset: int) -> int:
        """Block size of the live allocation at ``offset``."""
        try:
            return self._used[offset]
        except KeyError:
            raise InvalidInputError(f"offset {offset} is not allocated") from None

    # -- allocate / free --------------------------------------------------------

    def allocate(self, nbytes: int) -> int | None:
        """Reserve ``nbytes``; return the offset, or ``None`` if no block fits now.

        The smallest free block that fits is used (lowest offset on ties), so
        large blocks survive for large requests.
        """
        size = self.block_size(nbytes)
        i = bisect.bisect_left(self._free_by_size, (size, -1))
        if i == len(self._free_by_size):
            return None
        block, offset = self._free_by_size[i]
        self._remove_free(offset)
        if block > size:
            self._add_free(offset + size, block - size)
        self._used[offset] = size
        self._used_bytes += size
        return offset

    def free(self, offset: int) -> None:
        """Return the block at ``offset`` and merge it with free neighbours.

        Raises
        ------
        InvalidInputError
            If ``offset`` is not a live allocation (double free).
        """
        size = self._used.pop(offset, None)
        if size is None:
            raise InvalidInputError(f"offset {offset} is not allocated (double free?)")
        self._used_bytes -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == end:
            end += self._remove_free(end)
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_size[prev] == start:
                start = prev
                self._remove_free(prev)
        self._add_free(start, end - start)

    # -- free-block index --------------------------------------------------------

    def _add_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_offsets, offset)
        bisect.insort(self._free_by_size, (size, offset))
        self._free_size[offset] = size

    def _remove_free(self, offset: int) -> int:
        size = self._free_size.pop(offset)
        del self._free_offsets[bisect.bisect_left(self._free_offsets, offset)]
        del self._free_by_size[bisect.bisect_left(self._free_by_size, (size, offset))]
        return size

    def __repr__(self) -> str:
        return (f"FreeListAllocator(capacity={self._capacity}, used={self._used_bytes}, "
                f"free_blocks={len(self._free_offsets)}, largest_free={self.largest_free})")
