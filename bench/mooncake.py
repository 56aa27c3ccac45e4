"""Mooncake Store as bench.peers runs it: its own master, a holder process, a reader with registered buffers.

Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``, whose store
library does not link libcudart; it needs the system's ``libibverbs1``)
keeps objects in *global segments* that client processes contribute, and
a ``mooncake_master`` process places them. It is used here the way its
users run it for speed:

- the bench starts its own master on free ports of the given address
  (loopback by default) and stops it by its process id (never another
  master by name); the master and a holder die with the process that
  started them, so a killed bench leaves no store behind;
- a *holder* contributes the only global segment and does nothing else,
  the way a StorageUnit holds a unit's bytes: a process of this host
  (:func:`holder`) or a Ray actor on another one (:class:`SegmentHolder`);
- the *client* (the bench's worker process) contributes no segment (size
  0, a local buffer only), registers one source and one destination buffer
  once, and moves a shard with ``batch_put_from`` and ``batch_get_into``
  (zero-copy from and into registered memory), ``batch`` keys a call.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator

import numpy as np

__all__ = ["master_binary", "MooncakeMaster", "MooncakeClient", "SegmentHolder", "holder", "mooncake_import_error"]

_MIB = 1 << 20
_INSTALL = "pip install 'gputq[bench]' (mooncake-transfer-engine-non-cuda) and apt install libibverbs1"
_START_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def mooncake_import_error() -> str | None:
    """Why Mooncake Store cannot run here, or ``None`` when its store module imports."""
    try:
        importlib.import_module("mooncake.store")
    except Exception as exc:  # ImportError, or OSError when libibverbs is missing
        return f"{type(exc).__name__}: {exc}; {_INSTALL}"
    return None


def master_binary() -> str:
    """Path of the ``mooncake_master`` binary the wheel ships beside its Python package.

    Raises
    ------
    ImportError
        When the wheel is not installed (with what to install).
    """
    try:
        import mooncake
    except ImportError as exc:
        raise ImportError(f"Mooncake Store is not installed: {_INSTALL}") from exc
    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.path.isfile(path):
        raise ImportError(f"{path} is missing: reinstall with {_INSTALL}")
    return path


def _die_with_parent() -> None:
    """Have the kernel stop this process when its parent exits (Linux), so a killed bench leaves no store."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class MooncakeMaster:
    """A ``mooncake_master`` of this bench's own, on free loopback ports; a context manager.

    Eviction is off (high watermark 1.0, ratio 0): a store that drops
    objects under pressure would time the gets of a smaller shard.
    Stopped by its pid on exit, also when the body raised.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = _free_port(host)
        self.address = f"{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "MooncakeMaster":
        cmd = [master_binary(), f"--rpc_address={self.host}", f"--rpc_port={self.port}",
               f"--metrics_host={self.host}", f"--metrics_port={_free_port(self.host)}",
               "--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0.0",
               "--logtostderr=true", "--minloglevel=1"]  # warnings and errors, and no log files left behind
        # A file, not a pipe: nobody reads the log while the bench runs, and a full pipe would stall the master.
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     preexec_fn=_die_with_parent)
        try:
            self._wait_listening()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: "
                                   f"{self._log.read().decode(errors='replace')[-500:]}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.5):
                return
            time.sleep(0.05)
        raise TimeoutError(f"mooncake_master did not listen on {self.address} within {_START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        """Terminate the master by pid (kill after 10 s) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def __exit__(self, *exc) -> None:
        self.stop()


def _store(master: str, segment_bytes: int, local_buffer_bytes: int, host: str = "127.0.0.1"):
    os.environ.setdefault("GLOG_minloglevel", "1")  # the client's INFO lines would bury the bench's stderr
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    # P2PHANDSHAKE: no metadata server; peers exchange segment descriptors directly.
    ret = store.setup(host, "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "", master)
    if ret != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {ret} (master {master})")
    return store


def _hold(master: str, segment_bytes: int, ready, stop) -> None:
    """The holder process: contribute ``segment_bytes`` of global segment until ``stop`` is set."""
    _die_with_parent()
    store = _store(master, segment_bytes, 16 * _MIB)
    ready.set()
    stop.wait()
    store.close()


class MooncakeClient:
    """A client contributing no segment, with one registered source and one destination buffer.

    Parameters
    ----------
    master : str
        The master's ``host:port``.
    capacity : int
        Bytes of the largest shard: the size of each registered buffer and
        of the local buffer.
    host : str
        This process's address, as the holder reaches it.
    """

    def __init__(self, master: str, capacity: int, host: str = "127.0.0.1"):
        self._store = _store(master, 0, capacity + 64 * _MIB, host)
        self.source = np.empty(capacity, np.uint8)
        self.dest = np.empty(capacity, np.uint8)
        for buf in (self.source, self.dest):
            buf.fill(0)  # fault the pages in once, as a long-lived registered pool has
            ret = self._store.register_buffer(buf.ctypes.data, buf.nbytes)
            if ret != 0:
                raise RuntimeError(f"register_buffer returned {ret}")

    def stage(self, arrays: list[np.ndarray]) -> list[tuple[int, int]]:
        """Copy ``arrays`` into the registered source once; returns each one's (offset, nbytes)."""
        spans, offset = [], 0
        for array in arrays:
            self.source[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)
            spans.append((offset, array.nbytes))
            offset += array.nbytes
        return spans

    def put(self, keys: list[str], spans: list[tuple[int, int]], batch: int) -> None:
        """``batch_put_from`` the staged spans under ``keys``, ``batch`` keys a call; raises on a failed key."""
        base = self.source.ctypes.data
        for names, offsets, sizes in _batches(keys, spans, batch):
            codes = self._store.batch_put_from(names, [base + o for o in offsets], sizes)
            if any(c != 0 for c in codes):
                raise RuntimeError(f"batch_put_from failed with codes {sorted(set(codes))}")

    def get(self, keys: list[str], spans: list[tuple[int, int]], batch: int) -> None:
        """``batch_get_into`` the registered destination at the spans' offsets; raises on a short read."""
        base = self.dest.ctypes.data
        for names, offsets, sizes in _batches(keys, spans, batch):
            got = list(self._store.batch_get_into(names, [base + o for o in offsets], sizes))
            if got != sizes:
                raise RuntimeError(f"batch_get_into read {got[:4]} bytes, expected {sizes[:4]}")

    def arrays(self, spans: list[tuple[int, int]], like: list[np.ndarray]) -> list[np.ndarray]:
        """The destination's spans as arrays shaped and typed as ``like`` (views, no copy)."""
        return [self.dest[off:off + n].view(a.dtype).reshape(a.shape) for (off, n), a in zip(spans, like)]

    def remove(self, keys: list[str]) -> None:
        """Remove ``keys`` at once (``force``: a key's read lease would otherwise hold it for seconds)."""
        self._store.batch_remove(keys, force=True)

    def close(self) -> None:
        """Unregister both buffers and leave the cluster."""
        for buf in (self.source, self.dest):
            self._store.unregister_buffer(buf.ctypes.data)
        self._store.close()


class SegmentHolder:
    """A holder on another host (a Ray actor there): contributes ``segment_bytes`` until :meth:`close`."""

    def __init__(self, master: str, segment_bytes: int, host: str):
        self._store = _store(master, segment_bytes, 16 * _MIB, host)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self._store.close()


def _batches(keys: list[str], spans: list[tuple[int, int]], batch: int) -> Iterator[tuple[list, list, list]]:
    for i in range(0, len(keys), batch):
        chunk = spans[i:i + batch]
        yield keys[i:i + batch], [off for off, _ in chunk], [n for _, n in chunk]


@contextlib.contextmanager
def holder(master: str, segment_bytes: int) -> Iterator[multiprocessing.Process]:
    """A holder process contributing ``segment_bytes``; stopped and joined on exit."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(master, segment_bytes, ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(_START_TIMEOUT_S):
            raise TimeoutError(f"the Mooncake holder did not mount its segment within {_START_TIMEOUT_S:.0f} s")
        yield proc
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
