"""Host memory for whole-shard restores, reused once the caller has dropped what was restored into it.

:meth:`Reader.fetch <gputq.client.reader.Reader.fetch>` returns numpy
arrays that the caller owns for as long as it likes (slime keeps them in its
samples for the step). A trainer restores a shard of about the same size
every step, and writing into freshly allocated memory costs its first touch:
on a VM, pages the guest never used fault in at about a twentieth of the
speed of a warm write. So each fetch's output buffers come from a
:class:`HostOutputs`, whose arrays report back when the last of them (views
and torch tensors of them included) is gone; the next fetch writes into that
memory again. Nothing is reused while any array of it is alive.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

__all__ = ["HostOutputs"]


class _Lent:
    """The owner of the arrays :meth:`HostOutputs.take` hands out; its death hands the buffer back.

    numpy keeps the object whose ``__array_interface__`` it wrapped as the
    array's base, and every view and ``torch.from_numpy`` tensor keeps that
    array: this dies with the last of them.
    """

    __slots__ = ("__array_interface__", "_buffer", "__weakref__")

    def __init__(self, buffer: np.ndarray, nbytes: int):
        self._buffer = buffer
        self.__array_interface__ = {"data": (buffer.ctypes.data, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


class HostOutputs:
    """Output buffers of one reader's whole-shard host restores, reused across fetches.

    Keeps free buffers up to twice the largest one taken (a shard's fields
    of one step, with room for the step before), so memory stays bounded by
    what the trainer's own steps use.
    """

    def __init__(self):
        self._free: list[np.ndarray] = []  # appended from finalizers, which may run inside take()
        self._lock = threading.Lock()
        self._largest = 0
        self._closed = False

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``; its memory comes back here once no array of it is alive."""
        nbytes = int(nbytes)
        with self._lock:
            self._largest = max(self._largest, nbytes)
            free = self._free
            fits = [i for i, b in enumerate(free) if b.nbytes >= nbytes]
            buffer = free.pop(min(fits, key=lambda i: free[i].nbytes)) if fits else None
            while sum(b.nbytes for b in free) > 2 * self._largest:  # the oldest go first
                free.pop(0)
        if buffer is None:
            buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        owner = _Lent(buffer, nbytes)
        weakref.finalize(owner, self._give_back, buffer)
        return np.asarray(owner)

    def _give_back(self, buffer: np.ndarray) -> None:
        if not self._closed:
            self._free.append(buffer)  # no lock: a finalizer can run in any thread, this one's included

    @property
    def free_bytes(self) -> int:
        """Bytes of buffers waiting for the next fetch."""
        return sum(b.nbytes for b in list(self._free))

    def close(self) -> None:
        """Drop the free buffers; arrays still alive keep theirs. Idempotent."""
        self._closed = True
        self._free.clear()
