"""A compact source that stays where it is: byte ranges of mapped host memory.

The zero-copy restore reads a shard's compact bytes straight out of the
units' arenas (page-locked, mapped into the GPU's address space) instead of
copying them into a staging buffer first. :class:`MappedSource` stands in
for that staging buffer: it describes where each staging byte range lives
(an address per segment: a device address of mapped memory for a GPU
restore, a host address for a host one) and behaves like the staging array
as far as a restore uses it (``nbytes``, a leading slice, ``view(dtype)``).
:func:`kernels.widen_scatter` given one translates the plan's staging rows
into those addresses and runs the kernel (or, into host memory, the host
codec) on them: the compact bytes are read once, where they lie. Packed IDs
(:func:`kernels.unpack_scatter`) are unpacked so into host memory only.
"""

from __future__ import annotations

import numpy as np

from gputq.errors import PlanError

from .cupy_backend import widen_scatter_from_pointer
from .plan import as_plan_array, check_unpack_call
from .host_native import unpack_scatter_mapped_host, widen_scatter_host, widen_scatter_mapped_host
from .reference import unpack_rows_into

__all__ = ["MappedSource", "SPAN_GAP_BYTES"]

#: Bytes between two segments that :meth:`MappedSource.staged_in` copies
#: through rather than start a second copy: one large memcpy moves bytes much
#: faster than many of a few MiB each (glibc streams large copies with
#: non-temporal stores; smaller ones pull the destination through the cache),
#: and into GPU memory each copy is a launch.
SPAN_GAP_BYTES = 64 << 10


class MappedSource:
    """Staging bytes scattered over device-accessible (mapped host) memory.

    Parameters
    ----------
    starts : array of int
        Staging byte offset of each segment, ascending; segments do not
        overlap (gaps are bytes no plan reads).
    addresses : array of int
        Device address of each segment's first byte.
    lengths : array of int
        Bytes of each segment.
    nbytes : int
        Size of the staging buffer this stands for.
    dtype : numpy dtype, optional
        Element type seen through :meth:`view`.
    """

    def __init__(self, starts, addresses, lengths, nbytes: int, dtype=np.uint8):
        self.starts = np.asarray(starts, np.int64)
        self.addresses = np.asarray(addresses, np.int64)
        self.lengths = np.asarray(lengths, np.int64)
        self.nbytes = int(nbytes)
        self.dtype = np.dtype(dtype)

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __getitem__(self, key) -> "MappedSource":
        """A leading slice ``[:n]`` (what a restore takes of its staging buffer)."""
        if not isinstance(key, slice) or key.start not in (None, 0) or key.step not in (None, 1):
            raise PlanError("a mapped source supports leading slices [:n] only")
        stop = self.size if key.stop is None else min(int(key.stop), self.size)
        return MappedSource(self.starts, self.addresses, self.lengths, stop * self.dtype.itemsize, self.dtype)

    def view(self, dtype) -> "MappedSource":
        dtype = np.dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise PlanError(f"{self.nbytes} bytes are not whole {dtype.name} elements")
        return MappedSource(self.starts, self.addresses, self.lengths, self.nbytes, dtype)

    def element_plan(self, plan, width: int) -> tuple[np.ndarray, int, int]:
        """Translate a row plan over the staging bytes into one over device memory.

        Returns
        -------
        plan : numpy.ndarray, int64 [n, 3]
            ``(src_elem, dst_elem, elems)`` relative to ``base`` (``-1`` fill).
        base : int
            Device address of source element 0 (the lowest segment address,
            rounded down to an element).
        src_elems : int
            Elements readable from ``base`` (up to the highest segment end).

        Raises
        ------
        PlanError
            A copied fragment does not lie inside one segment.
        """
        plan = as_plan_array(plan)
        itemsize = self.dtype.itemsize
        row_bytes = width * itemsize
        lowest = int(self.addresses.min()) if len(self.addresses) else 0
        # Element-aligned: another field's segments (uint16 rows of an odd top-k) may start the
        # lowest on 2 bytes, and offsets from there would misalign this field's 4-byte elements.
        base = lowest - lowest % itemsize
        top = int((self.addresses + self.lengths).max()) if len(self.addresses) else 0
        out = np.empty_like(plan)
        np.multiply(plan[:, 1:], width, out=out[:, 1:])
        copy = plan[:, 0] >= 0
        first = plan[copy, 0] * row_bytes
        seg = np.searchsorted(self.starts, first, side="right") - 1
        inside = (seg >= 0) & (first + plan[copy, 2] * row_bytes <= self.starts[seg] + self.lengths[seg])
        if not inside.all():
            i = int(np.flatnonzero(copy)[np.flatnonzero(~inside)[0]])
            raise PlanError(f"plan row {i} reads staging bytes that no mapped segment holds")
        src = self.addresses[seg] + (first - self.starts[seg]) - base
        if (src % itemsize).any():
            raise PlanError(f"mapped segments are not aligned to {itemsize}-byte elements")
        out[:, 0] = -1
        out[copy, 0] = src // itemsize
        return out, base, (top - base) // itemsize

    def widen_scatter(self, plan, width: int, out, fill=0, *, validate=True, stream=None):
        """:func:`kernels.widen_scatter` with this as the staging buffer.

        A CUDA ``out`` needs device addresses (the kernel reads over PCIe);
        a numpy ``out`` needs host addresses, which the host codec (or the numpy
        reference) reads in place: one widening pass from the mapping into ``out``.
        """
        if isinstance(out, np.ndarray) and not validate and widen_scatter_mapped_host(
                (self.starts, self.addresses, self.lengths), self.dtype, plan, int(width), out.reshape(-1), fill) \
                is not None:
            return out  # the codec translated each row to its segment as it went: no element plan built
        elements, base, src_elems = self.element_plan(plan, int(width))
        if isinstance(out, np.ndarray):
            return widen_scatter_host(self._host_elements(base, src_elems), elements, 1, out.reshape(-1), fill,
                                      validate=validate)
        return widen_scatter_from_pointer(base, self.dtype, src_elems, elements, out, fill,
                                          validate=validate, stream=stream)

    def unpack_scatter(self, plan, topk: int, bits: int, out, fill=0, *, validate=True):
        """:func:`kernels.unpack_scatter` with this (uint8 packed rows) as the staging buffer, into a numpy
        ``out``: the host codec (or numpy, a plan row at a time) unpacks each row where it lies.

        Raises
        ------
        PlanError
            As :func:`kernels.unpack_scatter` does, for a plan row outside
            one segment, or for a CUDA ``out``: the unpack kernel reads
            staging in device memory (a GPU restore stages packed IDs).
        """
        if not isinstance(out, np.ndarray):
            raise PlanError("packed IDs left in mapped memory unpack into host memory only; a GPU restore "
                            "stages them first")
        plan, fill, row_bytes = check_unpack_call(self.dtype.name, self.size, out.dtype.name, out.size, plan,
                                                  topk, bits, fill, validate)
        segments = (self.starts, self.addresses, self.lengths)
        if unpack_scatter_mapped_host(segments, plan, topk, bits, out.reshape(-1), fill) is not None:
            return out
        rows_out = out.reshape(-1, topk)
        for i, (first, dst, rows) in enumerate(plan.tolist()):
            try:
                if rows < 0 or dst < 0 or dst + rows > len(rows_out):
                    raise PlanError(f"it writes outside the {len(rows_out)} out rows")
                if first < 0:
                    rows_out[dst:dst + rows] = fill
                else:
                    packed = self.host_array(first * row_bytes, rows * row_bytes).reshape(rows, row_bytes)
                    unpack_rows_into(packed, topk, bits, rows_out[dst:dst + rows])
            except PlanError as exc:
                raise PlanError(f"plan row {i} {[first, dst, rows]}: {exc}") from None
        return out

    def spans(self, max_gap: int = SPAN_GAP_BYTES) -> tuple[list, list, list]:
        """The segments grouped into spans of memory to copy at once, in address order.

        Returns the address and length of each span, and each segment's
        offset in the spans laid back to back (lists: a segment is a key
        of tens of KiB or more, so a plain loop costs nothing beside its
        copy, where a dozen numpy calls would, in caches a copy just swept).
        """
        starts, lengths, offsets, _ = self._layout(max_gap)
        return starts, lengths, offsets

    def _layout(self, max_gap: int) -> tuple[list, list, list, list]:
        """:meth:`spans`, and each span's offset in the copy: back to back, each at its address's offset
        from the first modulo 16, so that a segment whose elements were aligned in the arena stays so
        (a span may end on any byte: packed IDs, odd rows of uint8)."""
        addresses, lengths = self.addresses.tolist(), self.lengths.tolist()
        starts, ends, offsets, at, packed = [], [], [0] * len(addresses), [], 0
        for i in sorted(range(len(addresses)), key=addresses.__getitem__):
            address, end = addresses[i], addresses[i] + lengths[i]
            if starts and address <= ends[-1] + max_gap:
                ends[-1] = max(ends[-1], end)
            else:
                if starts:
                    packed += ends[-1] - starts[-1]
                    packed += (address - starts[0] - packed) % 16
                starts.append(address)
                ends.append(end)
                at.append(packed)
            offsets[i] = packed + address - starts[-1]
        return starts, [end - start for start, end in zip(starts, ends)], offsets, at

    def staged_in(self, allocate, copy_runs, max_gap: int = SPAN_GAP_BYTES) -> "MappedSource":
        """Copy the segments (host memory) into a buffer; the same source over the copy.

        Segments less than ``max_gap`` apart are copied as one span, the gap
        with them. ``allocate(nbytes)`` returns the buffer to copy the spans
        into (at least ``nbytes``): host memory, or CUDA memory (a CuPy
        array). ``copy_runs(out, src, runs)`` copies (src offset, out
        offset, length) runs from the host view ``src`` into it
        (:func:`gputq.transport.arena_copies.copy_runs` or ``device_copy_runs``).
        """
        starts, lengths, offsets, at = self._layout(max_gap)
        base = starts[0] if starts else 0
        runs = [(start - base, where, length) for start, where, length in zip(starts, at, lengths)]
        total = at[-1] + lengths[-1] if starts else 0
        buffer = allocate(total)
        if buffer.nbytes < total:
            raise PlanError(f"staging the mapped segments needs {total} bytes, the buffer holds {buffer.nbytes}")
        out = buffer.reshape(-1).view(np.uint8)  # numpy, or CuPy for a GPU restore
        if total:  # spans are disjoint and in address order: the last one ends highest
            copy_runs(out, _bytes_at(base, starts[-1] + lengths[-1] - base), runs)
        cuda = getattr(out, "__cuda_array_interface__", None)
        address = (cuda or out.__array_interface__)["data"][0]
        return MappedSource(self.starts, [address + offset for offset in offsets], self.lengths, self.nbytes,
                            self.dtype)

    def host_array(self, first: int, count: int) -> np.ndarray:
        """Elements ``[first, first + count)`` of the staging view where they lie (host addresses).

        Flagged writable only because torch refuses to wrap read-only arrays
        without a warning: a restore reads it, and nothing writes to it.

        Raises
        ------
        PlanError
            The range does not lie inside one segment.
        """
        start, nbytes = first * self.dtype.itemsize, count * self.dtype.itemsize
        seg = int(np.searchsorted(self.starts, start, side="right")) - 1
        if seg < 0 or start + nbytes > self.starts[seg] + self.lengths[seg]:
            raise PlanError(f"staging bytes [{start}, {start + nbytes}) lie in no single mapped segment")
        return _bytes_at(int(self.addresses[seg]) + start - int(self.starts[seg]), nbytes,
                         writable=True).view(self.dtype)

    def _host_elements(self, base: int, src_elems: int) -> np.ndarray:
        # A view over [base, base + src_elems) that touches no byte by itself: between the
        # segments of several arenas it spans unmapped addresses, which no plan row reads
        # (element_plan checked every copied fragment lies inside one segment). Read-only.
        return _bytes_at(base, src_elems * self.dtype.itemsize).view(self.dtype)


class _Memory:
    """Bytes at an address, for ``numpy.asarray`` (cheaper than a ctypes array type per length)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, nbytes: int, writable: bool):
        self.__array_interface__ = {"data": (address, not writable), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


def _bytes_at(address: int, nbytes: int, *, writable: bool = False) -> np.ndarray:
    """A uint8 view of ``nbytes`` at ``address`` (read-only unless ``writable``), touching none of them."""
    return np.asarray(_Memory(address, nbytes, writable))
