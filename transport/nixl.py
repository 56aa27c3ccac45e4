"""The rdma backend: one-sided NIXL READs out of a StorageUnit's arena.

Data plane: the unit registers its arena with a NIXL agent once, at start.
A reader process owns one NIXL agent and one pool of registered destination
buffers (:mod:`gputq.transport.nixl_pool`), both shared by all its channels and
reused across reads, so no memory is registered per request.
:meth:`NixlTransport.destination` lends a pool buffer: a read of any
channel into any slice of it is one NIXL READ straight into it, with no
copy. One read is one NIXL READ whose descriptor list covers every region
of every key, built with numpy.

Control plane: the tcp backend. The unit serves tcp beside NIXL, and a
:class:`NixlChannel` reaches the unit through a
:class:`~gputq.transport.tcp.TcpChannel`: the token handshake first, then the
``nixl_connect`` call, the only source of the unit's NIXL agent metadata and
arena base (they let a NIXL peer read and write the whole arena; see
docs/security.md). A read leases its keys (``lease``: the unit checks the
keys' generations and its incarnation), READs the leased regions one-sided,
then makes sure the lease covered the whole READ, which is what makes a
one-sided read safe against a release racing it. A READ completed well
inside the lease lifetime the unit states, counted from before the lease
request, was covered for sure: the lease is ended in the background
(:mod:`gputq.transport.lease_ends`) and the read costs one control round trip.
A slower one confirms with ``end_lease``: the unit answers whether the
lease was still held. It was not when the reader was slower than the unit's
lease timeout; the regions may have been reused meanwhile, so the read
raises :class:`~gputq.errors.StaleReadError` and returns nothing.

GPU destinations: where a NIC can DMA into GPU memory (GPUDirect, see
:func:`gputq.transport.policy.gpudirect_support`) the READ lands in a registered
device buffer; elsewhere it lands in host memory and one copy moves it to
the device (faster than letting UCX stage device destinations itself in
software; docs/gpu/ has the figures).

Writes go over tcp, or large ones are pushed with NIXL WRITEs into their
reserved regions (:mod:`gputq.transport.nixl_push`); both directions' transfers
are :class:`~gputq.transport.nixl_transfer.Transfers`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Sequence

import numpy as np

from gputq.errors import (
    GputqError,
    InvalidInputError,
    RequestTooLargeError,
    TransferError,
    TransferSetupError,
)
from gputq.transport.base import TransportType, byte_view, is_device_buffer
from gputq.transport.handler import ArenaHandler, ServerLimits
from gputq.transport.nixl_pool import DRAM, LocalAgent, cuda_device_of, host_ptr, import_nixl, local_pool
from gputq.transport.nixl_push import Pushes, chosen_write_path
from gputq.transport.nixl_server import CONNECT, NixlServer
from gputq.transport.nixl_transfer import Transfers
from gputq.transport.one_sided import HeldLease, LeaseProtocol, LeasingChannel
from gputq.transport.policy import gpudirect_support
from gputq.transport.staging import device_nbytes
from gputq.transport.tcp import TcpTransport

_log = logging.getLogger(__name__)

__all__ = ["NixlTransport", "NixlServer", "NixlChannel", "import_nixl", "local_pool"]


# -- client side -----------------------------------------------------------------------

def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _destination(dest) -> tuple[int, int, int, bool]:
    """``dest``'s address, capacity in bytes, CUDA device (0 on the host) and whether it is device memory."""
    if is_device_buffer(dest):
        ptr = int(dest.__cuda_array_interface__["data"][0])
        return ptr, device_nbytes(dest), cuda_device_of(dest, ptr), True
    ptr, capacity = host_ptr(dest)
    return ptr, capacity, 0, False


# A failed read's end_lease must reach the unit even after the caller's
# deadline expired, but must not hang forever on a lost unit.
_CLEANUP_TIMEOUT_S = 5.0


class NixlChannel(LeasingChannel):
    """A client of one unit: NIXL READs for data, tcp for control.

    Build it with :meth:`NixlTransport.connect`. Thread-safe: each read takes
    its own pool buffer (or READs into a caller's disjoint slice of a lent
    one), the tcp channel pools connections and the shared NIXL agent runs
    in RW sync mode.

    Attributes
    ----------
    pool : BufferPool
        The process-wide registered buffers, shared by every channel of this
        process (``pool.registrations`` counts registrations).
    copies : int
        Reads of this channel that READ into a pool buffer and then copied
        into ``dest`` because ``dest`` was not registered memory.
    """

    kind = "rdma"

    def __init__(self, address: dict, *, token: str, max_frame_bytes: int,
                 timeout: float | None = None, write_path: str = "auto"):
        if address.get("transport") != "rdma" or not isinstance(address.get("control"), dict):
            raise InvalidInputError(f"not an rdma address (no control lane): {sorted(address)}")
        self._closed = False
        self._local = LocalAgent.get()
        # READ straight into GPU memory only where a NIC can DMA there; else
        # UCX stages in software, slower than a READ into host memory plus a
        # host-to-device copy (docs/gpu/). None: try
        # on the first CUDA read, fall back for good if NIXL refuses.
        self._vram_direct: bool | None = None if gpudirect_support()[0] else False
        self._tcp = TcpTransport().connect(address["control"], token=token,
                                           max_frame_bytes=max_frame_bytes, timeout=timeout)
        self.unit, self.incarnation = self._tcp.unit, self._tcp.incarnation
        self._leases = LeaseProtocol(self._tcp, self.unit)
        try:
            info = self._tcp.call(CONNECT, timeout=timeout)
            base, self._arena_nbytes = int(info["arena_base"]), int(info["arena_nbytes"])
            self._remote = self._local.add_remote(info["agent_metadata"])
            # Dropped unclosed (its clients never closed), the channel still stops counting as open.
            self._dropped = weakref.finalize(self, self._local.dropped, self._remote)
        except BaseException as exc:
            self._tcp.close()
            if isinstance(exc, GputqError) or not isinstance(exc, Exception):
                raise
            raise TransferError(f"cannot add the NIXL agent of unit {self.unit}: {exc}", self.unit) from exc
        self.pool = self._local.pool
        self._transfers = Transfers(self._local.agent, self._remote, base, self.unit)
        self._writes = Pushes(self._tcp, self._transfers, self.pool, self._arena_nbytes, write_path)
        self.copies = 0
        self._copies_lock = threading.Lock()

    # -- reads -------------------------------------------------------------------------

    def read(self, keys: Sequence[str], dest, timeout: float | None = None, *,
             generations: Sequence[int] | None = None, incarnation: str | None = None,
             spans=None) -> list[int]:
        """Read ``keys`` back to back into ``dest`` with one NIXL READ, then confirm it.

        With ``spans`` the unit lends only those byte ranges of the keys'
        blobs and the READ's descriptors cover exactly them.

        ``dest`` may be host memory, a CUDA buffer, or any slice of a buffer
        from :meth:`NixlTransport.destination` or :meth:`staging`: then the
        READ lands in it directly, with no copy. Other destinations get one
        copy from a pool buffer (counted in :attr:`copies`), made only once
        the read is confirmed.

        Raises
        ------
        gputq.errors.UnknownKeyError
            A key is not stored on the unit (the unit's error, rebuilt by
            class name where ``gputq.errors`` is imported).
        StaleReadError
            ``incarnation`` is not the unit's, a key's generation is not the
            one in ``generations``, or the lease expired before the READ was
            confirmed: ``dest`` holds garbage.
        RequestTooLargeError
            ``dest`` is smaller than the keys' bytes.
        GputqTimeoutError
            The lease, transfer or completion outlasted ``timeout``.
        PeerLostError
            The unit's process disconnected during the transfer.
        TransferError
            NIXL failed the transfer otherwise; names the unit and the keys.
        """
        self._check_open()
        keys = list(keys)
        if not keys:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        held = self.lease_ahead(keys, _left(deadline), generations=generations, incarnation=incarnation, spans=spans)
        return self._read_held(held, dest, deadline)

    @property
    def leases_ahead(self) -> bool:
        return True

    def read_leased(self, held: HeldLease, dest, timeout: float | None = None) -> list[int]:
        """:meth:`read` what ``held`` names, under it: no round trip before the READ.

        A lease past :data:`~gputq.transport.one_sided.FRESH_FRACTION` of its
        lifetime, or one another channel took, is ended and taken again
        first (the READ might outlast it otherwise); integrity is
        :meth:`read`'s.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        if held.owner is not self or not held.fresh():
            if held.owner is self:
                self._leases.ends.defer(held.lease_id)
            held = self._leases.hold(held.keys, held.request, _left(deadline), self)
        else:
            self.leased_ahead += 1
        return self._read_held(held, dest, deadline)

    def _read_held(self, held: HeldLease, dest, deadline: float | None) -> list[int]:
        """READ the regions of ``held`` into ``dest``, then settle the lease (see :meth:`read`)."""
        keys = held.keys
        staged, copied = None, False
        try:
            try:
                ptr, capacity, device, on_device = _destination(dest)
                regions = self._leases.regions(held.reply, keys, self._arena_nbytes, held.rows)
                lengths = regions[:, 1]
                total = int(lengths.sum())
                if total > capacity:
                    raise RequestTooLargeError(
                        f"read of {len(keys)} keys from {self.unit} needs {total} bytes, dest holds {capacity}")
                staged = self._read_leased(keys, regions, total, ptr, device, on_device, deadline)
                copied = True
            finally:  # held from first to last byte: ended in the background; else confirmed in the read's time
                self._leases.settle(held.reply, held.started, keys, ok=copied,
                                    timeout=_left(deadline) if copied else _CLEANUP_TIMEOUT_S)
            if staged is not None:  # copied out of the pool buffer only once confirmed
                self._copy_out(staged[0], staged[1], ptr, dest, total, device, on_device)
        finally:
            if staged is not None:
                self.pool.release(staged[0])
        return lengths.tolist()

    def _read_leased(self, keys, regions, total, ptr, device, on_device, deadline):
        """READ the leased regions; return ``(pool buffer, kind)`` when a copy-out is due."""
        direct = self.pool.find(ptr, total)
        if direct is not None and (direct[0] == "DRAM" or self._vram_direct is not False):
            try:
                self._transfers.run("READ", keys, regions, ptr, direct, deadline)
            except TransferSetupError:
                if direct[0] == "DRAM":
                    raise
                self._vram_direct = False  # device staging view: go through host memory below
            else:
                if direct[0] == "VRAM":
                    self._vram_direct = True
                return None
        if on_device and self._vram_direct is not False:
            staged = self._read_into_vram(keys, regions, total, device, deadline)
            if staged is not None:
                return staged
        buf = self.pool.acquire(total, DRAM)
        self._read_into(buf, keys, regions, DRAM, deadline)
        return buf, DRAM

    def _read_into_vram(self, keys, regions, total, device, deadline):
        """READ straight into device memory, or ``None`` when this UCX cannot.

        The wheel's UCX reads into GPU memory over InfiniBand with GPUDirect;
        other lanes may refuse the registration or the transfer, and then
        every later read of this channel stages through host memory.
        """
        kind = ("VRAM", device)
        try:
            buf = self.pool.acquire(total, kind)
        except Exception as exc:  # no CUDA-aware UCX, or no device memory
            _log.info("unit %s: no device registration (%s); staging through host memory", self.unit, exc)
            self._vram_direct = False
            return None
        try:
            self._read_into(buf, keys, regions, kind, deadline)
        except TransferSetupError as exc:
            _log.info("unit %s: NIXL cannot READ into device memory (%s); staging through host memory",
                      self.unit, exc)
            self._vram_direct = False
            return None
        self._vram_direct = True
        return buf, kind

    def _read_into(self, buf, keys, regions, kind, deadline) -> None:
        try:
            self._transfers.run("READ", keys, regions, buf.ptr, kind, deadline)
        except TransferSetupError:
            self.pool.release(buf)  # nothing moved: the buffer is clean
            raise
        except BaseException:
            self.pool.discard(buf)  # an aborted READ may still land in it
            raise

    def _copy_out(self, buf, kind, ptr: int, dest, total: int, device: int, on_device: bool) -> None:
        with self._copies_lock:
            self.copies += 1
        if not on_device:
            out = np.frombuffer(byte_view(dest, writable=True), np.uint8)
            np.copyto(out[:total], buf.obj[:total])
        elif total:
            self.pool.cuda().copy(ptr, buf.ptr, total, device, src_host=kind[0] == "DRAM")

    @contextlib.contextmanager
    def staging(self, nbytes: int, device: int | None = None):
        """Lend a registered buffer of ``nbytes`` from the process-wide pool.

        A :meth:`read` (of any channel) into it is one NIXL READ with no
        copy: read a shard into it, then run the widen+scatter kernel
        straight from it. For host memory this is
        :meth:`NixlTransport.destination`.

        Parameters
        ----------
        nbytes : int
            Size of the view handed out.
        device : int or None
            CUDA device for a device buffer (CuPy or torch array); ``None``
            for a host numpy array.
        """
        self._check_open()
        kind = DRAM if device is None else ("VRAM", int(device))
        with self.pool.lend(nbytes, kind) as view:
            yield view

    # -- writes ---------------------------------------------------------------------------

    def write(self, key: str, payload, meta: dict | None = None, timeout: float | None = None) -> dict:
        """Store ``payload`` under ``key``: over tcp, or pushed with NIXL WRITEs (see ``write_path``)."""
        self._check_open()
        return self._writes.write(key, payload, meta, timeout)

    def write_many(self, items, timeout: float | None = None) -> list:
        """:meth:`write` of every ``(key, payload, meta)``: those that go over tcp in batched requests (see
        :meth:`TcpChannel.write_many <gputq.transport.tcp.TcpChannel.write_many>`), the pushed ones reserved
        and committed together (:mod:`gputq.transport.reserved_writes`)."""
        self._check_open()
        return self._writes.write_many(items, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._leases.close()
        self._dropped.detach()
        self._local.remove_remote(self._remote)
        self._tcp.close()



class NixlTransport(TransportType):
    """The rdma backend: ``serve`` an arena over NIXL, ``connect`` a :class:`NixlChannel`.

    Parameters
    ----------
    write_path : str or None
        ``None`` (default): ``GPUTQ_RDMA_WRITE_PATH``, else ``"auto"``.
        ``"auto"``: tcp below :data:`~gputq.transport.nixl_push.PUSH_MIN_BYTES`, push above;
        ``"tcp"``: always the tcp write (``recv_into`` the arena);
        ``"push"``: always NIXL WRITE from a registered staging buffer.
    """

    name = "rdma"

    def __init__(self, write_path: str | None = None):
        self.write_path = chosen_write_path(write_path)

    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0, token: str,
              limits: ServerLimits = ServerLimits()) -> NixlServer:
        return NixlServer(handler, host=host, port=port, token=token, limits=limits)

    def connect(self, address: dict, *, token: str, max_frame_bytes: int,
                timeout: float | None = None) -> NixlChannel:
        return NixlChannel(address, token=token, max_frame_bytes=max_frame_bytes, timeout=timeout,
                           write_path=self.write_path)

    registered_destinations = True

    def destination(self, nbytes: int):
        """Lend a registered host buffer of ``nbytes`` from the process-wide pool.

        A context manager yielding a 1-D uint8 numpy array. A read of any
        rdma channel of this process into any slice of it is one NIXL READ
        straight into it, with no copy; reads from several threads into
        disjoint slices may run at once. Nothing is registered per call:
        the pool reuses its buffers and grows by doubling. The array must
        not be used after the ``with`` block (the buffer is lent again).

        Raises
        ------
        InvalidInputError
            ``nbytes`` is not an int >= 0.
        MissingDependencyError
            NIXL or its UCX plugin is not available.
        """
        return local_pool().lend(nbytes)
