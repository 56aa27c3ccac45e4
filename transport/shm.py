"""The shm backend: same-host reads straight out of a StorageUnit's arena file.

A unit's arena is a ``MAP_SHARED`` mapping of a file in ``/dev/shm``. A
reader on the same host maps that file too, read-only (``PROT_READ``; the
file's permissions stay as the unit set them), and copies the bytes of a
read straight from its mapping: no socket, no kernel copy, no server thread
on the data path.

The backend is client-side: the unit serves tcp (or rdma, whose ``control``
address is tcp) and an :class:`ShmChannel` talks to that lane for
everything but the bytes. A read is

1. ``"lease"`` over the control lane: the unit pins the keys' regions (with
   a deadline: a reader that dies does not pin them forever) and answers
   their offsets, checking the reference's generations and incarnation;
2. the copy from the mapping: into host memory one ``numpy.copyto`` per run
   of regions adjacent in the arena (large reads are split over a few
   threads where there are cores for them); into GPU memory one
   ``cudaMemcpyAsync`` per run, from the mapping registered with CUDA once
   per channel (read-only, page-locked). The copy does not wait for the
   lease's reply: the unit also publishes where each stored key lies in a
   directory file (:mod:`gputq.transport.directory`) mapped here read-only, and
   the copy runs from the regions it names while a helper thread sends
   the request and reads the reply. It stands when the reply leases
   exactly those regions (the key was then stored there all along);
   otherwise it is made again under a second lease
   (:class:`HintMissedError` inside);
3. the confirmation that the lease covered the whole copy. When the copy
   ended well inside the lifetime the unit states for the lease, measured
   from before the request, the lease provably held and is ended in the
   background (:mod:`gputq.transport.lease_ends`): one round trip per read.
   Otherwise ``"end_lease"`` answers whether it was still held; an expired
   lease means the unit may have reused a region while it was copied: the
   read raises :class:`StaleReadError` and the destination is garbage.

Where the arena file cannot be mapped (another host or container, no
permission, a server that does not answer ``"arena_file"``) the channel
reads over rdma instead when the unit serves it and NIXL imports (cma on
one host), else over the control lane's tcp path, and says why in
:attr:`ShmChannel.fallback_reason`.

:meth:`ShmChannel.mapped_source` lends the leased regions where they lie:
as device addresses of the mapping (mapped, page-locked host memory), so a
kernel can read compact bytes from the arena over PCIe with no copy at all,
or as host addresses, so a host restore widens straight out of the arena.
It too lends the directory's regions while the lease is requested, and
raises :class:`HintMissedError` when the block ends if the lease named
others: the caller restores again with ``ahead=False``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Sequence

import numpy as np

from gputq.errors import (
    HintMissedError,
    InvalidInputError,
    MissingDependencyError,
    RequestTooLargeError,
)
from gputq.transport import arena_copies
from gputq.transport.arena_mapping import ArenaMapping
from gputq.transport.base import Channel, TransportType, byte_view, describe_keys, is_device_buffer
from gputq.transport.cuda import mapped_device_pointer
from gputq.transport.directory import DirectoryView, directory_nbytes
from gputq.transport.handler import ArenaHandler, ServerLimits
from gputq.transport.hinted_leases import HintedLeases, read_checks
from gputq.transport.nixl import NixlTransport
from gputq.transport.one_sided import ARENA_FILE, HeldLease, LeaseProtocol, LeasingChannel
from gputq.transport.policy import local_hostname, nixl_import_error
from gputq.transport.reserved_writes import ArenaFileWrites
from gputq.transport.spans import spans_to_wire
from gputq.transport.staging import device_nbytes
from gputq.transport.tcp import TcpTransport

__all__ = ["ShmTransport", "ShmChannel", "LEASE_THREADS"]

_log = logging.getLogger(__name__)


#: Helper threads of one channel running lease requests while their copies run (a unit's
#: reads at once). Each channel has its own: a unit that stops answering holds up its own
#: reads only, never another unit's.
LEASE_THREADS = 4

class ShmChannel(LeasingChannel):
    """A channel reading a same-host unit's arena through a read-only mapping.

    Build it with :meth:`ShmTransport.connect`. Writes and control calls go
    over the unit's tcp lane unchanged.

    Attributes
    ----------
    mapping : ArenaMapping or None
        The arena mapping; ``None`` when the channel fell back to tcp reads.
    fallback_reason : str or None
        Why reads go over rdma or tcp, when they do.
    directory : DirectoryView or None
        The unit's key directory, mapped read-only; ``None`` when the unit
        publishes none (reads then wait for the lease before copying).
    reads_ahead : int
        Reads whose copy, made from the directory while the lease was
        requested, the lease confirmed.
    hint_misses : int
        Reads whose directory regions the lease did not confirm (copied again).
    """

    kind = "shm"

    def __init__(self, address: dict, *, token: str, max_frame_bytes: int, timeout: float | None = None):
        control = address.get("control") if address.get("transport") == "rdma" else address
        if not isinstance(control, dict):
            raise InvalidInputError(f"not a tcp or rdma address: {address!r}")
        self._closed = False
        self._tcp = TcpTransport().connect(control, token=token, max_frame_bytes=max_frame_bytes,
                                           timeout=timeout)
        self.unit = self._tcp.unit
        self.incarnation = getattr(self._tcp, "incarnation", address.get("incarnation"))
        self._leases = LeaseProtocol(self._tcp, self.unit)
        self.mapping: ArenaMapping | None = None
        self.directory: DirectoryView | None = None
        self._directory_mapping: ArenaMapping | None = None
        self._hints: HintedLeases | None = None  # the reads' leases, once the arena is mapped
        self.fallback_reason: str | None = None
        self._writes: ArenaFileWrites | None = None
        host = address.get("hostname")
        if host is not None and host != local_hostname():
            self.fallback_reason = f"unit {self.unit} runs on host {host!r}, not here ({local_hostname()!r})"
        else:
            try:
                info = self._tcp.call(ARENA_FILE, timeout=timeout)
                self.mapping = ArenaMapping(str(info["path"]), int(info["nbytes"]))
                self._writes = ArenaFileWrites(self._tcp, self.unit, self.mapping.path, self.mapping.nbytes)
            except Exception as exc:  # InvalidInputError from an older server, OSError, ...
                self.fallback_reason = f"cannot map the arena file of unit {self.unit}: {exc}"
            else:
                self._map_directory(info.get("directory"))
                self._hints = HintedLeases(self._leases, self.unit, self.mapping.nbytes, self.directory,
                                           LEASE_THREADS)
        self._fallback = None  # the channel reads go through when the arena is not mapped
        if self.fallback_reason is not None:
            self._fallback = self._fallback_channel(address, token, max_frame_bytes, timeout)
            _log.warning("shm channel to %s reads over %s: %s", self.unit,
                         "rdma" if self._fallback is not self._tcp else "tcp", self.fallback_reason)

    def _map_directory(self, directory) -> None:
        """Map the unit's key directory, when it names one; reads wait for their lease without it."""
        if not isinstance(directory, dict):
            return
        try:
            slots = int(directory["slots"])
            self._directory_mapping = ArenaMapping(str(directory["path"]), directory_nbytes(slots))
            self.directory = DirectoryView(self._directory_mapping.array, slots)
        except Exception as exc:  # a malformed answer or an unmappable file costs one round trip a read
            _log.info("unit %s: key directory not mapped (%s); reads wait for their lease", self.unit, exc)
            if self._directory_mapping is not None:
                self._directory_mapping.close()
            self._directory_mapping = self.directory = None

    def _fallback_channel(self, address: dict, token: str, max_frame_bytes: int, timeout) -> Channel:
        """rdma for a unit that serves it and where NIXL imports (cma on one host), else the tcp lane."""
        if address.get("transport") == "rdma" and nixl_import_error() is None:
            try:
                return NixlTransport().connect(address, token=token, max_frame_bytes=max_frame_bytes,
                                               timeout=timeout)
            except Exception as exc:  # NIXL's agent or UCX refused: tcp still works
                _log.info("shm fallback to rdma for %s failed (%s); reading over tcp", self.unit, exc)
        return self._tcp

    # -- reads -------------------------------------------------------------------------

    def read(self, keys: Sequence[str], dest, timeout: float | None = None, *,
             generations: Sequence[int] | None = None, incarnation: str | None = None,
             spans=None) -> list[int]:
        """Read ``keys`` (or their ``spans``) back to back into ``dest`` (host or CUDA memory) from the mapping.

        With ``generations``, the copy runs from the unit's key directory
        while the lease is requested; a lease naming other regions costs a
        second lease and copy, never wrong bytes.

        Raises
        ------
        gputq.errors.UnknownKeyError
            The unit stores no such key (its own error, rebuilt by class name).
        StaleReadError
            A generation or the incarnation does not match, or the lease
            expired before the copy finished (``dest`` is then garbage).
        RequestTooLargeError
            ``dest`` is smaller than the keys' bytes.
        """
        self._check_open()
        keys = list(keys)
        if self.mapping is None:
            return self._fallback.read(keys, dest, timeout, spans=spans, **read_checks(generations, incarnation))
        on_device = is_device_buffer(dest)
        if on_device:
            capacity = device_nbytes(dest)
        else:
            out = np.frombuffer(byte_view(dest, writable=True), np.uint8)
            capacity = out.nbytes
        if not keys:
            return []
        wire_spans = None if spans is None else spans_to_wire(spans, len(keys))
        hinted = self._hints.regions(keys, generations, capacity, wire_spans)
        while True:
            try:
                with self._leased(keys, generations, incarnation, timeout, hinted=hinted,
                                  spans=wire_spans) as regions:
                    lengths = regions[:, 1]
                    total = int(lengths.sum())
                    if total > capacity:
                        raise RequestTooLargeError(f"read of {len(keys)} keys from {self.unit} needs {total} "
                                                   f"bytes, dest holds {capacity}")
                    runs = zip(*(a.tolist() for a in arena_copies.merge_runs(regions)))
                    if on_device:
                        self.mapping.register()
                        arena_copies.device_copy_runs(dest, self.mapping.array, runs)
                    else:
                        arena_copies.copy_runs(out, self.mapping.array, runs)
                return lengths.tolist()
            except HintMissedError:
                if hinted is None:
                    raise
                hinted = None  # copy again, after the lease

    @contextlib.contextmanager
    def mapped_source(self, keys: Sequence[str], timeout: float | None = None, *,
                      generations: Sequence[int] | None = None, incarnation: str | None = None,
                      device: bool = True, ahead: bool = True, spans=None):
        """Lease ``keys`` and lend their bytes (or only their ``spans``) where they lie in the mapping.

        Yields an int64 ``[n, 2]`` array of (address, length) per key (per
        span with ``spans``, see :meth:`read`): with
        ``device`` (the default), device addresses of the mapping registered
        as page-locked, mapped host memory that a kernel reads over PCIe;
        else host addresses in this process. Keep every read of them inside
        the ``with`` block (kernels synchronised before it ends): the lease is
        confirmed on exit, and an expired lease raises
        :class:`StaleReadError` (what was read is garbage).

        With ``ahead`` and ``generations``, the block gets the regions the
        unit's key directory names at once and runs while the lease is
        requested; when the lease names other regions, exit raises
        :class:`HintMissedError`: read again with ``ahead=False``.

        Raises
        ------
        MissingDependencyError
            ``device`` and the mapping cannot be registered with CUDA here
            (see :meth:`device_mappable`), or the arena is not mapped at all.
        """
        self._check_open()
        if self.mapping is None or (device and not self.device_mappable()):
            reason = self.fallback_reason or (self.mapping.register_error if self.mapping else None)
            raise MissingDependencyError(f"unit {self.unit}: no mapped arena for zero-copy reads ({reason})")
        if device:
            base = mapped_device_pointer(self.mapping.address)
        else:
            base = self.mapping.address
        keys = list(keys)
        wire_spans = None if spans is None else spans_to_wire(spans, len(keys))
        hinted = self._hints.regions(keys, generations, float("inf"), wire_spans) if ahead else None
        with self._leased(keys, generations, incarnation, timeout, hinted=hinted, spans=wire_spans) as regions:
            lent = regions.copy()
            lent[:, 0] += base
            yield lent

    @contextlib.contextmanager
    def directory_lent(self, keys: Sequence[str], generations: Sequence[int], spans=None):
        """The regions the unit's key directory names for ``keys`` (or their ``spans``), as host addresses
        (int64 ``[n, 2]`` of address, length) with the mapping held for the block, or None where it names
        them not all.

        A hint only (see :mod:`gputq.transport.directory`): a block that
        reads them stands once a lease of the same keys names the same
        regions and provably covered the read.
        """
        self._check_open()
        keys = list(keys)
        wire = None if spans is None else spans_to_wire(spans, len(keys))
        hinted = self._hints.regions(keys, generations, float("inf"), wire) if self.mapping is not None else None
        if hinted is None:
            yield None
            return
        with self._lent(hinted) as lent:
            yield lent

    @contextlib.contextmanager
    def mapped_lease(self, held: HeldLease):
        """The regions of a lease taken ahead (:meth:`lease_ahead`) where they lie in the mapping: host
        addresses, int64 ``[n, 2]`` of (address, length), the mapping held mapped for the block.

        One lease may serve several blocks (a stream leases a window of
        micro-batches at once). The holder settles it: a block that ends
        past the lease's proven lifetime (see
        :func:`~gputq.transport.lease_ends.lease_covered`) read garbage, and
        :meth:`drop_lease` ends it once no block will read it.

        Raises
        ------
        HintMissedError
            Another channel (one reconnected since) took the lease: lease again.
        MissingDependencyError
            The arena is not mapped here.
        """
        self._check_open()
        if self.mapping is None:
            raise MissingDependencyError(f"unit {self.unit}: no mapped arena for zero-copy reads "
                                         f"({self.fallback_reason})")
        if held.owner is not self:
            raise HintMissedError(f"unit {self.unit}: the lease of keys {describe_keys(held.keys)} was taken on "
                                  f"another connection; lease them again")
        with self._lent(self._leases.regions(held.reply, held.keys, self.mapping.nbytes, held.rows)) as lent:
            yield lent

    @contextlib.contextmanager
    def _lent(self, regions: np.ndarray):
        """``regions`` (arena offset, length) as host addresses in the mapping, held mapped for the block."""
        with self.mapping.held():
            lent = regions.astype(np.int64)  # a copy: a reply's bytes are read-only
            lent[:, 0] += self.mapping.address
            yield lent

    def device_mappable(self) -> bool:
        """True when the arena is mapped here and registered with CUDA (tried once)."""
        return self.mapping is not None and self.mapping.register()

    @contextlib.contextmanager
    def _leased(self, keys: list, generations, incarnation, timeout: float | None, *, hinted=None, spans=None):
        """:meth:`HintedLeases.lease <gputq.transport.hinted_leases.HintedLeases.lease>`, with the mapping held
        for the block: a close meanwhile (a lost unit's, on the
        heartbeat's thread) unmaps it only once the block's reads of it are done."""
        with self.mapping.held(), self._hints.lease(keys, generations, incarnation, timeout, hinted=hinted,
                                                    spans=spans) as regions:
            yield regions

    # -- writes and control -------------------------------------------------------------------

    def write(self, key: str, payload, meta: dict | None = None, timeout: float | None = None) -> dict:
        """Store ``payload`` under ``key``: copied into the mapped arena (see :meth:`write_many`)."""
        (result,) = self.write_many([(key, payload, meta)], timeout)
        if isinstance(result, Exception):
            raise result
        return result

    def write_many(self, items, timeout: float | None = None) -> list:
        """Store ``(key, payload, meta)`` items, copied straight into the unit's arena file mapped writable
        (:class:`~gputq.transport.reserved_writes.ArenaFileWrites`); over tcp where it cannot be mapped so."""
        self._check_open()
        if self._writes is None:
            return self._tcp.write_many(items, timeout)
        return self._writes.write_many(items, timeout)

    @property
    def write_fallback_reason(self) -> str | None:
        """Why writes go over tcp although the arena is mapped for reads, or None."""
        return None if self._writes is None else self._writes.fallback_reason

    @property
    def reads_ahead(self) -> int:
        """Reads whose copy, made from the key directory while the lease was requested, the lease confirmed."""
        return 0 if self._hints is None else self._hints.reads_ahead

    @property
    def hint_misses(self) -> int:
        """Reads whose directory regions the lease did not confirm (copied again)."""
        return 0 if self._hints is None else self._hints.hint_misses

    @property
    def writes_copied(self) -> int:
        """Writes this channel copied straight into the unit's arena."""
        return 0 if self._writes is None else self._writes.copied

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._leases.close()
        if self._hints is not None:
            self._hints.close()
        if self._writes is not None:
            self._writes.close()
        for mapping in (self.mapping, self._directory_mapping):
            if mapping is not None:
                mapping.close()
        if self._fallback is not None and self._fallback is not self._tcp:
            self._fallback.close()
        self._tcp.close()


class ShmTransport(TransportType):
    """The shm backend: ``connect`` maps a same-host unit's arena.

    Units have no shm server of their own: :meth:`serve` starts the tcp
    server, whose control lane is all an shm reader needs.
    """

    name = "shm"

    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0, token: str,
              limits: ServerLimits = ServerLimits()):
        return TcpTransport().serve(handler, host=host, port=port, token=token, limits=limits)

    def connect(self, address: dict, *, token: str, max_frame_bytes: int,
                timeout: float | None = None) -> ShmChannel:
        return ShmChannel(address, token=token, max_frame_bytes=max_frame_bytes, timeout=timeout)
