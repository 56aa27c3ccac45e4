"""Copies out of a mapped arena: into host memory shared over free threads, into GPU memory by DMA.

A same-host read (:mod:`gputq.transport.shm`) copies the regions its lease names
straight from the unit's arena mapping. Regions adjacent in the arena are
one run (:func:`merge_runs`), copied at once.

Into host memory, a copy of at least :data:`PARALLEL_COPY_BYTES` is cut
into pieces of :data:`COPY_PIECE_BYTES` that any free thread takes in turn
(numpy releases the GIL while it copies): the caller,
``COPY_THREADS - 1`` threads of a pool, and any thread that calls
:func:`help_copies`. The shm channel's lease helpers call it once their
reply is in: on a box with few cores the unit's answer to the lease needs
the other core at the start of a copy, and the helper that waited for
that answer takes pieces once it is free, where a thread started with the
copy would only have competed with the unit for that core.

Into GPU memory, one ``cudaMemcpyAsync`` per run from the (page-locked)
mapping on the current stream, then a wait: the lease must cover the copy.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gputq.errors import MissingDependencyError
from gputq.transport.cuda import usable_cupy, usable_torch

__all__ = ["merge_runs", "copy_runs", "device_copy_runs", "help_copies", "COPY_THREADS", "PARALLEL_COPY_BYTES",
           "COPY_PIECE_BYTES"]

#: Threads copying one large host read, the caller's among them: one memcpy thread does not
#: saturate a server's memory bus, a few of them do more of it. Half the cores, at most 4; on a
#: 2-core machine the caller alone, joined by lease helpers as they come free.
COPY_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
#: Host copies from this size are cut into pieces that free threads share.
PARALLEL_COPY_BYTES = 8 << 20
#: The piece a thread takes at a time: small enough that a thread coming free late in a copy
#: still takes a share, large enough that taking one costs nothing beside its copy.
COPY_PIECE_BYTES = 1 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_under_way: set["_SharedCopy"] = set()  # large host copies that free threads may join


def merge_runs(regions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of ``regions`` (int64 ``[n, 2]`` of offset, length) adjacent in the arena.

    Regions are packed back to back in the destination. Returns, per run,
    its arena offset, its destination offset and its length; empty runs
    are dropped. Keys written in sequence usually lie back to back, so a
    read of many keys is one run: one copy instead of one per key.
    """
    offsets, lengths = regions[:, 0], regions[:, 1]
    packed = np.cumsum(lengths) - lengths
    if not len(regions):
        return offsets, packed, lengths
    starts = np.concatenate(([0], np.flatnonzero(offsets[1:] != offsets[:-1] + lengths[:-1]) + 1))
    ends = np.concatenate((starts[1:], [len(regions)]))
    run_lengths = packed[ends - 1] + lengths[ends - 1] - packed[starts]
    keep = run_lengths > 0
    return offsets[starts][keep], packed[starts][keep], run_lengths[keep]


class _SharedCopy:
    """One large host copy in pieces; each thread that calls :meth:`take` copies pieces until none are left."""

    def __init__(self, out: np.ndarray, src: np.ndarray, runs: list):
        self._out, self._src = out, src
        self._pieces = iter([(offset + i, packed + i, min(COPY_PIECE_BYTES, n - i))
                             for offset, packed, n in runs for i in range(0, n, COPY_PIECE_BYTES)])
        self._copying = 0  # threads inside take()
        self._idle = threading.Condition()
        self._error: BaseException | None = None

    def take(self) -> None:
        with self._idle:
            self._copying += 1
        try:
            # A list iterator hands each piece to one thread. Once the owner has seen it run
            # out, a thread arriving late finds nothing: the owner waits for the others only.
            for offset, packed, n in self._pieces:
                np.copyto(self._out[packed:packed + n], self._src[offset:offset + n])
        except BaseException as exc:
            self._error = self._error or exc
        finally:
            with self._idle:
                self._copying -= 1
                self._idle.notify_all()

    def finish(self) -> None:
        """Wait until no other thread still copies a piece; raise the first error any met."""
        with self._idle:
            self._idle.wait_for(lambda: not self._copying)
        if self._error is not None:
            raise self._error


def _copy_pool() -> ThreadPoolExecutor:
    """Threads for large host copies, created on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, COPY_THREADS - 1), thread_name_prefix="gputq-arena-copy")
        return _pool


def _forget_copies_in_child() -> None:
    # A forked child has none of its parent's threads, but their pool would take work and
    # count them as idle: every large read would wait forever. The child starts its own.
    global _pool, _pool_lock, _under_way
    _pool, _pool_lock, _under_way = None, threading.Lock(), set()


os.register_at_fork(after_in_child=_forget_copies_in_child)


def copy_runs(out: np.ndarray, src: np.ndarray, runs) -> None:
    """Copy runs (src offset, destination offset, length) from ``src`` into ``out``.

    A copy of at least :data:`PARALLEL_COPY_BYTES` is shared with free
    threads in pieces (see the module's note); a smaller one is one
    ``copyto`` per run in this thread. Returns once every byte is copied:
    no other thread still writes into ``out``.
    """
    runs = list(runs)
    if sum(n for _, _, n in runs) < PARALLEL_COPY_BYTES:
        for offset, packed, n in runs:
            np.copyto(out[packed:packed + n], src[offset:offset + n])
        return
    copy = _SharedCopy(out, src, runs)
    helpers = [_copy_pool().submit(copy.take) for _ in range(COPY_THREADS - 1)]
    _under_way.add(copy)
    try:
        copy.take()
    finally:
        _under_way.discard(copy)
        for helper in helpers:
            helper.cancel()  # one that has not started would find no piece left
        copy.finish()


def help_copies() -> None:
    """Take pieces of the large host copies under way until none are left: for a thread come free."""
    for copy in list(_under_way):
        copy.take()


def device_copy_runs(out, src: np.ndarray, runs) -> None:
    """:func:`copy_runs` into CUDA memory ``out`` from host memory ``src`` (page-locked for speed):
    one ``cudaMemcpyAsync`` per run on the current stream, then waits for them."""
    _DeviceCopier(out).copy(int(out.__cuda_array_interface__["data"][0]), int(src.ctypes.data), runs)


class _DeviceCopier:
    """Host-to-device copies of runs of a mapping on the destination's stream (CuPy, else torch)."""

    def __init__(self, dest):
        self._cp, self._torch = usable_cupy(), usable_torch()
        if self._cp is None and self._torch is None:
            raise MissingDependencyError("reading into a CUDA buffer over shm needs CuPy or torch with a device")
        self._dest = dest

    def copy(self, dst: int, src_base: int, runs) -> None:
        """Copy every run (src offset, dst offset, length), then wait for the copies."""
        if self._cp is not None:
            cp = self._cp
            rt = cp.cuda.runtime
            with cp.cuda.Device(rt.pointerGetAttributes(dst).device):
                stream = cp.cuda.get_current_stream()
                for src, off, n in runs:
                    rt.memcpyAsync(dst + off, src_base + src, n, rt.memcpyHostToDevice, stream.ptr)
                stream.synchronize()  # the lease must cover the copy
            return
        torch = self._torch
        out = self._dest if isinstance(self._dest, torch.Tensor) else torch.as_tensor(self._dest, device="cuda")
        out = out.reshape(-1).view(torch.uint8)
        import ctypes

        for src, off, n in runs:
            host = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(src_base + src)))
            out[off:off + n].copy_(host, non_blocking=True)
        torch.cuda.current_stream(out.device).synchronize()
