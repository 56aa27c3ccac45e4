"""One contiguous host-memory arena, backed by a shared-memory file.

A StorageUnit allocates its whole arena once, at start. The memory is a
``MAP_SHARED`` mapping of a file in ``/dev/shm`` (or ``shm_dir``) so that a
later same-host path can map the very same pages from another process by
``path``; the file is removed on :meth:`Arena.close`.

When CUDA is usable the arena is page-locked with ``cudaHostRegister``
(:func:`gputq.transport.cuda.page_lock`, through CuPy, else torch), so
host-to-device copies and RDMA registration can use it without staging.
Without CUDA it stays plain pageable memory: that is a normal configuration
(tcp transport, CPU tests), not an error.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import time
import weakref

import numpy as np

from gputq.errors import ConfigError, InvalidInputError
from gputq.transport.base import Closeable
from gputq.transport.cuda import HOST_REGISTER_PORTABLE, host_unregister, page_lock

__all__ = ["Arena", "default_shm_dir", "sweep_orphans"]

log = logging.getLogger(__name__)

# Seen on an H200 host: a mapping of a file on ext4 fails with "invalid argument"
# (the kernel refuses long-term pins of file-backed pages outside tmpfs).
_PIN_HINT = ("a file-backed arena can only be pinned on tmpfs: use a shm_dir such as "
             "/dev/shm, or pin=False")

# Every unit start sweeps; an orphan it cannot remove (another user's file in a
# sticky /dev/shm) would otherwise be reported again by each start.
_SWEEP_WARNING_INTERVAL_S = 300.0
_last_sweep_warning = -float("inf")  # monotonic time of the last one


def default_shm_dir() -> str:
    """``/dev/shm`` where it exists (RAM-backed, mappable by name), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def sweep_orphans(folder: str) -> list[str]:
    """Remove arena files whose owning process is gone (killed units leave them behind).

    Arena files are named ``gputq-<pid>-...arena``; a file whose pid no
    longer runs on this host is an orphan. An orphan that cannot be removed
    (e.g. another user's) is skipped with a warning, at most one every few
    minutes. Returns the paths removed.
    """
    global _last_sweep_warning
    removed, skipped = [], []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-", 2)
        if len(parts) < 3 or parts[0] != "gputq" or not parts[1].isdigit() or not name.endswith(".arena"):
            continue
        if not _alive(int(parts[1])):
            path = os.path.join(folder, name)
            try:
                _remove_file(path)
            except OSError as exc:
                skipped.append(f"{path} ({exc.strerror or exc})")
                continue
            removed.append(path)
    now = time.monotonic()
    if skipped and now - _last_sweep_warning >= _SWEEP_WARNING_INTERVAL_S:
        _last_sweep_warning = now
        log.warning("cannot remove %d orphaned arena file(s) of dead units, skipped: %s; "
                    "their owner or root can delete them", len(skipped), ", ".join(skipped[:5]))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Arena(Closeable):
    """A fixed-size, shared-memory, optionally pinned byte buffer.

    Parameters
    ----------
    capacity_bytes : int
        Size of the arena; allocated (and its pages touched) at once.
    name : str
        Used in the backing file's name, for operators reading ``/dev/shm``.
    shm_dir : str, optional
        Directory of the backing file; default :func:`default_shm_dir`. It
        must be on tmpfs for the arena to be pinned.
    prefault : bool, optional
        Touch every page at start (``MAP_POPULATE``) so the first writes do
        not pay page faults.
    pin : bool, optional
        Page-lock the arena with CUDA when CUDA is usable (pageable memory
        otherwise). A registration that fails on a working CUDA raises
        :class:`~gputq.errors.GputqError` rather than silently losing
        the page-locked host-to-device copies, several times faster than
        pageable ones.

    Attributes
    ----------
    view : memoryview
        The whole arena, writable, format ``B``.
    array : numpy.ndarray
        The same bytes as a 1-D ``uint8`` array.
    path : str
        The backing file (removed on close).
    pinned : bool
        True when the arena is registered with CUDA.
    """

    def __init__(self, capacity_bytes: int, name: str, shm_dir: str | None = None, *,
                 prefault: bool = True, pin: bool = True):
        if capacity_bytes <= 0:
            raise InvalidInputError(f"arena capacity must be > 0 bytes, got {capacity_bytes}")
        self.name = name
        self.capacity = int(capacity_bytes)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:64]
        folder = shm_dir or default_shm_dir()
        sweep_orphans(folder)
        fd, self.path = tempfile.mkstemp(prefix=f"gputq-{os.getpid()}-{safe}-", suffix=".arena", dir=folder)
        # Remove the file even if the owner forgets close() or dies in __init__.
        self._finalizer = weakref.finalize(self, _remove_file, self.path)
        try:
            os.ftruncate(fd, self.capacity)
            # A sparse file on a small tmpfs maps fine and then kills the process
            # with SIGBUS on the first write past the free space: reserve it all now.
            try:
                os.posix_fallocate(fd, 0, self.capacity)
            except OSError as exc:
                raise ConfigError(
                    f"cannot reserve a {self.capacity} byte arena in {folder}: {exc.strerror} "
                    f"({shutil.disk_usage(folder).free} bytes free); lower unit_capacity_bytes "
                    f"or set shm_dir / GPUTQ_SHM_DIR to a larger tmpfs") from None
            flags = mmap.MAP_SHARED
            if prefault and hasattr(mmap, "MAP_POPULATE"):
                flags |= mmap.MAP_POPULATE
            self._mmap = mmap.mmap(fd, self.capacity, flags=flags,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._finalizer()
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        if prefault and not hasattr(mmap, "MAP_POPULATE"):
            self.array[::mmap.PAGESIZE] = 0  # one write per page faults it in
        # Portable: the unit's readers may copy from it under any CUDA context of the process.
        try:
            self._pinned = bool(pin) and page_lock(self.address, self.capacity, HOST_REGISTER_PORTABLE,
                                                   hint=_PIN_HINT)
        except BaseException:
            self._unmap()
            raise
        self.closed = False

    @property
    def pinned(self) -> bool:
        """True when the arena is page-locked with CUDA."""
        return self._pinned

    @property
    def address(self) -> int:
        """Virtual address of the first byte (for RDMA / CUDA registration)."""
        return int(self.array.ctypes.data)

    def close(self) -> None:
        """Unregister, unmap and remove the backing file. Idempotent.

        If a caller still holds a view of the arena the mapping stays alive
        until that view is gone (Python refuses to unmap exported memory);
        the file is removed regardless.
        """
        if self.closed:
            return
        self.closed = True
        try:
            if self._pinned:
                self._pinned = False
                host_unregister(self.address)
        finally:  # a refused unregister still frees the mapping and the file; the error is raised
            self._unmap()

    def _unmap(self) -> None:
        self.array = None
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            pass  # an outside view keeps the mapping; it is unmapped when that view dies
        self._finalizer()


    def __repr__(self) -> str:
        return (f"Arena(name={self.name!r}, capacity={self.capacity}, path={self.path!r}, "
                f"pinned={self.pinned}, closed={self.closed})")

