"""A StorageUnit's arena file mapped into a reader's (or a same-host writer's) address space.

A unit's arena is a ``MAP_SHARED`` file in ``/dev/shm``. A process on its
host maps it (read-only for readers) and reads the bytes of a lease where
they lie. The mapping is registered with CUDA once, read-only and
page-locked, where a GPU copies from it; it stays mapped while any block
that reads it by address holds it, whatever closes it meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import weakref

import numpy as np

from gputq.errors import ClosedError, TransferError
from gputq.transport.cuda import (
    HOST_REGISTER_MAPPED,
    HOST_REGISTER_PORTABLE,
    HOST_REGISTER_READ_ONLY,
    host_register,
    host_unregister,
    read_only_register_supported,
)

__all__ = ["ArenaMapping"]

_log = logging.getLogger(__name__)


def _unregister(address: int) -> None:
    """Unregister a mapping's range from CUDA."""
    with contextlib.suppress(Exception):  # best effort at teardown
        host_unregister(address)


class ArenaMapping:
    """A unit's arena file mapped into this process, read-only unless ``writable``.

    Parameters
    ----------
    path : str
        The arena file (``"arena_file"`` control call).
    nbytes : int
        The arena's size; the file must hold at least that much.
    writable : bool
        Map it for writing too (a writer on the unit's host, see
        :mod:`gputq.transport.reserved_writes`); readers never do.

    Raises
    ------
    OSError
        The file cannot be opened or mapped (another host, no permission).
    """

    def __init__(self, path: str, nbytes: int, *, writable: bool = False):
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise OSError(f"{path} holds {size} bytes, the unit's arena {nbytes}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        self.path = path
        self.nbytes = int(nbytes)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)  # read-only unless the mapping is writable
        self.address = int(self.array.ctypes.data)
        self._lock = threading.Lock()
        self._registered: bool | None = None  # None: not tried yet
        self.register_error: str | None = None
        self._holds, self._closing = 0, False

    def register(self) -> bool:
        """Page-lock the mapping with CUDA, read-only and mapped, once; True when it is.

        A refusal (no read-only registration on this driver, the page-lock
        limit) is remembered: copies then run from pageable memory.
        """
        with self._lock:
            if self._registered is None:
                try:
                    if not read_only_register_supported():
                        raise TransferError("this GPU does not register read-only host memory")
                    host_register(self.address, self.nbytes,
                                  HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED | HOST_REGISTER_READ_ONLY)
                    self._registered = True
                    # Dropped unclosed (its channel's clients never closed), the range is still unregistered:
                    # a finalizer runs before the mapping's attributes, its mmap among them, are cleared.
                    self._unregister = weakref.finalize(self, _unregister, self.address)
                except Exception as exc:  # the copy still works from pageable memory
                    self.register_error = f"{type(exc).__name__}: {exc}"
                    _log.warning("cannot page-lock the arena mapping %s (%s); GPU copies from it run "
                                 "from pageable memory", self.path, self.register_error)
                    self._registered = False
            return self._registered

    @property
    def registered(self) -> bool:
        return bool(self._registered)

    @contextlib.contextmanager
    def held(self):
        """Keep the mapping mapped for the block, whatever closes it meanwhile (then it is unmapped when the
        last block ends): what reads it by address, the restore or a kernel, would fault on an unmapped range.

        Raises ``ClosedError`` when it is closed already.
        """
        with self._lock:
            if self.array is None or self._closing:
                raise ClosedError(f"the arena mapping {self.path} was closed")
            self._holds += 1
        try:
            yield self
        finally:
            with self._lock:
                self._holds -= 1
                if self._closing and not self._holds:
                    self._unmap()

    def close(self) -> None:
        """Unregister and unmap, once no :meth:`held` block reads it. Idempotent; a view still held keeps the
        mapping alive."""
        with self._lock:
            if self._holds:
                self._closing = True  # the last held block unmaps it
                return
            self._unmap()

    def _unmap(self) -> None:
        """Unregister and unmap now (the caller holds the lock)."""
        if self._registered:
            self._unregister()
        self._registered = False
        if self.array is None:
            return
        self.array = None
        with contextlib.suppress(BufferError):
            self._mmap.close()
