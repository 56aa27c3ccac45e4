"""Pinned host staging for tcp reads into GPU memory.

A socket can only write into host memory, so a read whose destination is a
CUDA buffer receives into a small ring of pinned host chunks and copies each
chunk to the device asynchronously on a dedicated stream; the next chunk is
received while the previous copy runs. A slot is reused only after its
previous copy finished (one CUDA event per slot), and a read returns only
after the stream is synchronised, so the caller sees complete data.

The CUDA work is done by a *copier*: CuPy when it imports and sees a device,
else torch (:mod:`gputq.transport.cuda` decides, once per process). Both are imported lazily. The ring logic itself is independent
of CUDA, which lets tests drive it with a host-only copier.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from gputq.errors import InvalidInputError, MissingDependencyError
from gputq.transport.cuda import cuda_available, usable_cupy

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CHUNKS",
    "device_nbytes",
    "cuda_available",
    "StagingRing",
    "StagingPool",
]

DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_CHUNKS = 3


def device_nbytes(buf) -> int:
    """Size in bytes of a C-contiguous buffer exposing ``__cuda_array_interface__``."""
    cai = buf.__cuda_array_interface__
    shape = tuple(cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None:
        expected, step = [], itemsize
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if tuple(reversed(expected)) != tuple(strides) and int(np.prod(shape)) > 1:
            raise InvalidInputError("CUDA destination must be C-contiguous")
    return int(np.prod(shape, dtype=np.int64)) * itemsize


class _CupyCopier:
    """Pinned host slots and async H2D copies with CuPy."""

    def __init__(self, cupy, device_id: int, nchunks: int, chunk_bytes: int):
        self._cp = cupy
        self._device = cupy.cuda.Device(device_id)
        with self._device:
            self._stream = cupy.cuda.Stream()
            self._events = [None] * nchunks
            # Keep the pinned allocations alive as long as the numpy views.
            self._pinned = [cupy.cuda.alloc_pinned_memory(chunk_bytes) for _ in range(nchunks)]
        self.slots = [memoryview(np.frombuffer(m, np.uint8, chunk_bytes)) for m in self._pinned]
        self._dst = 0

    def target(self, dest) -> None:
        self._dst = int(dest.__cuda_array_interface__["data"][0])
        with self._device:  # order after work already queued on dest (e.g. its allocation's fill)
            self._stream.wait_event(self._cp.cuda.get_current_stream().record())

    def wait(self, slot: int) -> None:
        event = self._events[slot]
        if event is not None:
            event.synchronize()

    def copy_async(self, slot: int, offset: int, nbytes: int) -> None:
        cp = self._cp
        with self._device:
            cp.cuda.runtime.memcpyAsync(self._dst + offset, self._pinned[slot].ptr, nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
            event = self._events[slot] or cp.cuda.Event(block=False, disable_timing=True)
            event.record(self._stream)
            self._events[slot] = event

    def synchronize(self) -> None:
        self._stream.synchronize()


class _TorchCopier:
    """Pinned host slots and async H2D copies with torch."""

    def __init__(self, torch, device_index: int, nchunks: int, chunk_bytes: int):
        self._torch = torch
        self._device = torch.device("cuda", device_index)
        self._stream = torch.cuda.Stream(device=self._device)
        self._events = [None] * nchunks
        self._host = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(nchunks)]
        self.slots = [memoryview(t.numpy()) for t in self._host]
        self._dst = None

    def target(self, dest) -> None:
        torch = self._torch
        tensor = dest if isinstance(dest, torch.Tensor) else torch.as_tensor(dest, device=self._device)
        self._dst = tensor.reshape(-1).view(torch.uint8)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def wait(self, slot: int) -> None:
        event = self._events[slot]
        if event is not None:
            event.synchronize()

    def copy_async(self, slot: int, offset: int, nbytes: int) -> None:
        torch = self._torch
        with torch.cuda.stream(self._stream):
            self._dst[offset:offset + nbytes].copy_(self._host[slot][:nbytes], non_blocking=True)
            event = self._events[slot] or torch.cuda.Event()
            event.record(self._stream)
            self._events[slot] = event

    def synchronize(self) -> None:
        self._stream.synchronize()


def _device_of(dest) -> int:
    device = getattr(dest, "device", None)
    index = getattr(device, "index", None)  # torch
    if index is not None:
        return int(index)
    device_id = getattr(device, "id", None)  # cupy
    if device_id is not None:
        return int(device_id)
    cupy = usable_cupy()
    if cupy is not None:
        ptr = dest.__cuda_array_interface__["data"][0]
        return int(cupy.cuda.runtime.pointerGetAttributes(ptr).device)
    return 0


def _make_copier(dest, nchunks: int, chunk_bytes: int):
    cupy = usable_cupy()
    if cupy is not None:
        return _CupyCopier(cupy, _device_of(dest), nchunks, chunk_bytes)
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(
            "reading into a CUDA buffer over tcp needs CuPy or torch: "
            "pip install cupy-cuda12x (or torch)") from None
    if not torch.cuda.is_available():
        raise MissingDependencyError("no usable CUDA device for a GPU destination (CuPy and torch see none)")
    return _TorchCopier(torch, _device_of(dest), nchunks, chunk_bytes)


class StagingRing:
    """A ring of pinned host chunks feeding asynchronous host-to-device copies.

    Parameters
    ----------
    copier
        Owns the host slots (``slots``: list of equal-size writable
        memoryviews) and the copies: ``target(dest)`` starts a read into
        ``dest`` (ordered after work already queued on it),
        ``copy_async(slot, offset, nbytes)``, ``wait(slot)`` for a slot's
        last copy, and ``synchronize()``.
    """

    def __init__(self, copier):
        self._copier = copier
        self.chunk_bytes = copier.slots[0].nbytes
        self.nchunks = len(copier.slots)

    def receive(self, fill: Callable[[memoryview], None], dest, nbytes: int) -> None:
        """Receive ``nbytes`` into ``dest[0:nbytes]`` chunk by chunk.

        ``fill(view)`` must fill the host view completely (e.g.
        :meth:`gputq.transport.wire.FrameReader.recv_exact`). The stream is
        synchronised before returning, also on error, so no copy still
        reads a slot that a later read refills.
        """
        copier = self._copier
        copier.target(dest)
        offset, index = 0, 0
        try:
            while offset < nbytes:
                slot = index % self.nchunks
                step = min(self.chunk_bytes, nbytes - offset)
                copier.wait(slot)
                fill(copier.slots[slot][:step])
                copier.copy_async(slot, offset, step)
                offset += step
                index += 1
        finally:
            copier.synchronize()


class StagingPool:
    """Staging rings allocated lazily and reused, one per concurrent reader.

    Parameters
    ----------
    chunk_bytes, nchunks
        Geometry of each ring.
    make_copier
        ``make_copier(dest, nchunks, chunk_bytes)``; defaults to CuPy, else torch.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, nchunks: int = DEFAULT_CHUNKS,
                 make_copier: Callable | None = None):
        if chunk_bytes <= 0 or nchunks < 2:
            raise InvalidInputError("a staging ring needs chunk_bytes > 0 and at least 2 chunks")
        self.chunk_bytes = int(chunk_bytes)
        self.nchunks = int(nchunks)
        self._make_copier = make_copier or _make_copier
        self._lock = threading.Lock()
        self._free: list[StagingRing] = []

    def receive(self, fill: Callable[[memoryview], None], dest, nbytes: int) -> None:
        """Receive ``nbytes`` into the CUDA buffer ``dest`` through a free ring."""
        with self._lock:
            ring = self._free.pop() if self._free else None
        if ring is None:
            ring = StagingRing(self._make_copier(dest, self.nchunks, self.chunk_bytes))
        try:
            ring.receive(fill, dest, nbytes)
        finally:
            with self._lock:
                self._free.append(ring)

    def close(self) -> None:
        """Drop the rings (pinned memory is freed when unreferenced). Idempotent."""
        with self._lock:
            self._free.clear()
