"""Channels to the StorageUnits of one deployment: opened lazily, shared, and watched.

Writers, readers and the controller all talk to units through one
:class:`UnitClients`: it knows the membership (unit name -> address), picks
each pair's transport with the auto policy once, and keeps the channel.

Losing a unit. A request that loses its peer (connection refused, reset or
cut mid-frame) or runs out of its own timeout marks the unit *lost*: its
channel is closed, which ends every request still in flight on it, and
later requests fail at once with :class:`~gputq.errors.UnitLostError`
naming the unit and the keys asked for. A hung unit therefore costs one
timeout, not one per request. A unit answering "no space"
(:class:`~gputq.errors.CapacityError`), "busy"
(:class:`~gputq.errors.UnitBusyError`: it refused connections at its cap
for the whole timeout) or any other typed error of its own is alive and
stays live.

A lost unit is re-admitted as soon as a probe reaches it: :meth:`UnitClients.ping`
opens a fresh channel and makes one cheap control call. A background thread
pings the lost units every ``heartbeat_interval_s``; the controller pings
every unit on the same beat. Re-admitting is safe because references name
their unit: a unit that was only stalled still holds its keys, and one that
restarted answers reads of its old keys with typed errors of its own.
:attr:`UnitClients.live_units` (the membership minus lost units) is where
new keys are placed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from gputq.config import GputqConfig
from gputq.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    PeerLostError,
    UnitBusyError,
    UnitLostError,
    UnitTimeoutError,
)
from gputq.transport import get_transport
from gputq.transport.base import Channel, Closeable
from gputq.transport.policy import choose_transport

__all__ = ["UnitClients", "UnitChannel", "UnitReadPipeline", "PING_METHOD"]

log = logging.getLogger(__name__)

#: The control call a probe makes: every unit answers it, and it touches no key.
PING_METHOD = "lookup"
_KEYS_SHOWN = 8


def _is_loss(exc: BaseException) -> bool:
    """True when ``exc`` means the unit did not answer (not a typed answer from it)."""
    return (isinstance(exc, (PeerLostError, GputqTimeoutError))
            and not isinstance(exc, (CapacityError, UnitBusyError, UnitLostError)))


class UnitReadPipeline:
    """:class:`~gputq.transport.tcp_pipeline.ReadPipeline` of one unit under the loss rule.

    From :meth:`UnitChannel.pipeline`. Its transport pipeline (one
    connection) is opened by the first :meth:`send`; a lost peer or a
    timeout in :meth:`send` or :meth:`receive` marks the unit lost and
    raises :class:`UnitLostError` naming the keys. ``close`` is idempotent.
    """

    def __init__(self, owner: "UnitClients", unit: str):
        self._owner, self.unit = owner, unit
        self._pipe = None

    def send(self, keys: Sequence[str], timeout: float | None = None, **kwargs) -> None:
        """:meth:`ReadPipeline.send <gputq.transport.tcp_pipeline.ReadPipeline.send>`.

        Raises
        ------
        MissingDependencyError
            The unit's transport sends no reads ahead (shm, rdma).
        """
        def request(chan):
            if self._pipe is None:
                self._pipe = chan.pipeline()
            self._pipe.send(keys, timeout, **kwargs)

        self._owner._run(self.unit, keys, "read", request)

    def receive(self, sink, timeout: float | None = None, *, keys: Sequence[str] = (), chunk_bytes: int,
                breaks: Sequence[int] = ()) -> list[int]:
        """:meth:`ReadPipeline.receive <gputq.transport.tcp_pipeline.ReadPipeline.receive>`; ``keys``, those of
        the read being received, name it in a loss."""
        if self._pipe is None:
            raise ClosedError(f"no read of unit {self.unit} is in flight on this pipeline")
        pipe = self._pipe
        return self._owner._guarded(self.unit, keys, "read",
                                    lambda: pipe.receive(sink, timeout, chunk_bytes=chunk_bytes, breaks=breaks))

    def close(self) -> None:
        """Hand the connection back (dropped if a reply is pending). Idempotent."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None


class UnitChannel(Channel):
    """The channel to one unit as :meth:`UnitClients.channel` hands it out.

    It forwards ``write``, ``write_many``, ``read`` and ``call`` to the transport's channel
    and turns a lost peer or a timeout into :class:`UnitLostError` naming
    the unit and the keys; while the unit is marked lost, requests fail at
    once. ``close`` is a no-op: :class:`UnitClients` owns the connection.

    Same-host reads (the shm transport) add :meth:`mapped_source`,
    :meth:`mapped_lease` and :meth:`directory_lent`, under the same rule,
    byte-stream reads (tcp) add :meth:`pipeline`, one-sided reads (shm, rdma)
    :meth:`lease_ahead` and :meth:`drop_lease`, rdma :meth:`read_leased`, and
    the queries :attr:`pipelines_reads`, :attr:`leases_ahead`,
    :attr:`mapping`, :meth:`device_mappable`, :attr:`fallback_reason`,
    :attr:`reads_ahead`, :attr:`hint_misses` and :attr:`leased_ahead`, which
    answer "nothing mapped" (``None``, ``False``, ``0``) for other transports
    and while the unit is lost, so a reader takes the path whose requests name
    their keys. Nothing else of the transport channel shows through: each
    member decides how a lost unit appears.
    """

    def __init__(self, owner: "UnitClients", unit: str):
        self._owner = owner
        self.unit = unit

    def write(self, key: str, payload, meta: dict | None = None, timeout: float | None = None, **kwargs) -> dict:
        return self._owner._run(self.unit, (key,), "write",
                                lambda chan: chan.write(key, payload, meta, timeout=timeout, **kwargs))

    def write_many(self, items, timeout: float | None = None) -> list:
        """The transport channel's ``write_many``, under the loss rule (naming every item's key)."""
        return self._owner._run(self.unit, [item[0] for item in items], "write",
                                lambda chan: chan.write_many(items, timeout=timeout))

    def read(self, keys: Sequence[str], dest, timeout: float | None = None, **kwargs) -> list[int]:
        return self._owner._run(self.unit, keys, "read",
                                lambda chan: chan.read(keys, dest, timeout=timeout, **kwargs))

    def pipeline(self) -> "UnitReadPipeline":
        """Reads sent ahead of their replies (tcp: see :attr:`pipelines_reads`), under the loss rule."""
        return UnitReadPipeline(self._owner, self.unit)

    @property
    def pipelines_reads(self) -> bool:
        """True when reads of the unit can be sent ahead of their replies and received chunk by chunk as they
        land (tcp; False for other transports and while the unit is lost)."""
        chan = self._live()
        return chan is not None and chan.pipelines_reads

    @property
    def leases_ahead(self) -> bool:
        """True when a read's lease can be taken ahead of it (rdma; False for other transports and while the
        unit is lost)."""
        chan = self._live()
        return chan is not None and chan.leases_ahead

    def lease_ahead(self, keys: Sequence[str], timeout: float | None = None, **kwargs):
        """The transport channel's ``lease_ahead`` (the read's keyword arguments), under the loss rule."""
        return self._owner._run(self.unit, keys, "read", lambda chan: chan.lease_ahead(keys, timeout, **kwargs))

    def read_leased(self, held, dest, timeout: float | None = None) -> list[int]:
        """The transport channel's ``read_leased``, under the loss rule (a channel reconnected since the
        lease takes its own)."""
        return self._owner._run(self.unit, held.keys, "read", lambda chan: chan.read_leased(held, dest, timeout))

    def drop_lease(self, held) -> None:
        """End a lease taken ahead that no read will use; nothing to do while the unit is lost."""
        chan = self._live()
        if chan is not None:
            chan.drop_lease(held)

    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        keys = args.get("keys") or ()
        return self._owner._run(self.unit, keys if isinstance(keys, (list, tuple)) else (), method,
                                lambda chan: chan.call(method, timeout=timeout, **args))

    @contextlib.contextmanager
    def mapped_source(self, keys: Sequence[str], timeout: float | None = None, **kwargs) -> Iterator:
        """Lease ``keys`` and lend their bytes where they lie in the unit's mapped arena.

        :meth:`ShmChannel.mapped_source <gputq.transport.shm.ShmChannel.mapped_source>`
        (same arguments, a context manager yielding the ``[n, 2]`` addresses
        and lengths) under the loss rule: the lease is requested on entry and
        confirmed on exit, and a lost peer or a timeout in either marks the
        unit lost and raises :class:`UnitLostError` naming the keys. An error
        of the block itself passes through as it is.

        Raises
        ------
        MissingDependencyError
            The unit's transport maps no arena here (tcp, rdma), or the
            mapping cannot serve this read (see the shm channel).
        UnitLostError
            The unit is lost, or was lost while the lease was requested or
            confirmed.
        """
        keys, owner = list(keys), self._owner

        def enter(chan):
            source = chan.mapped_source(keys, timeout, **kwargs)
            return source, source.__enter__()

        source, regions = owner._run(self.unit, keys, "read", enter)
        try:
            yield regions
        except BaseException as exc:
            if not owner._guarded(self.unit, keys, "read", source.__exit__, type(exc), exc, exc.__traceback__):
                raise
        else:
            owner._guarded(self.unit, keys, "read", source.__exit__, None, None, None)

    def mapped_lease(self, held) -> contextlib.AbstractContextManager:
        """:meth:`ShmChannel.mapped_lease <gputq.transport.shm.ShmChannel.mapped_lease>` (the regions of a lease
        from :meth:`lease_ahead` where they lie in the mapping, held mapped for the block) under the loss
        rule; a channel reconnected since the lease raises ``HintMissedError`` (lease again)."""
        return self._held_mapping(held.keys, lambda chan: chan.mapped_lease(held))

    def directory_lent(self, keys: Sequence[str], generations: Sequence[int],
                       spans=None) -> contextlib.AbstractContextManager:
        """:meth:`ShmChannel.directory_lent <gputq.transport.shm.ShmChannel.directory_lent>` (the key directory's
        regions of ``keys``, a hint, held mapped for the block; None where it names them not all) under
        the loss rule."""
        return self._held_mapping(keys, lambda chan: chan.directory_lent(keys, generations, spans))

    @contextlib.contextmanager
    def _held_mapping(self, keys: Sequence[str], manager_of: Callable) -> Iterator:
        """Enter ``manager_of(chan)`` (a block holding the mapping, that asks nothing of the unit on exit) on
        the live channel, under the loss rule."""

        def enter(chan):
            manager = manager_of(chan)
            return manager, manager.__enter__()

        manager, lent = self._owner._run(self.unit, keys, "read", enter)
        try:
            yield lent
        finally:
            manager.__exit__(None, None, None)  # the mapping's hold ends

    @property
    def mapping(self):
        """The unit's arena as mapped here (shm), or None: the transport maps none, or the unit is lost."""
        chan = self._live()
        return None if chan is None else chan.mapping

    def device_mappable(self) -> bool:
        """True when the arena is mapped here and registered with CUDA (False for other transports
        and while the unit is lost)."""
        chan = self._live()
        if chan is None:
            return False
        return bool(self._owner._guarded(self.unit, (), "device_mappable", chan.device_mappable))

    @property
    def fallback_reason(self) -> str | None:
        """Why an shm channel reads over rdma or tcp, when it does (None otherwise, or while lost)."""
        chan = self._live()
        return None if chan is None else chan.fallback_reason

    def _counter(self, name: str) -> int:
        """The current channel's counter ``name``, one :class:`~gputq.transport.base.Channel` declares
        (0 while the unit is lost)."""
        chan = self._live()
        return 0 if chan is None else int(getattr(chan, name))

    @property
    def reads_ahead(self) -> int:
        """Reads of the current shm channel copied from the key directory ahead of their lease."""
        return self._counter("reads_ahead")

    @property
    def hint_misses(self) -> int:
        """Reads of the current shm channel whose directory regions the lease did not confirm."""
        return self._counter("hint_misses")

    @property
    def leased_ahead(self) -> int:
        """Reads of the current rdma channel that copied under a lease taken ahead of them."""
        return self._counter("leased_ahead")

    @property
    def incarnation(self) -> str:
        """The incarnation the unit announced on connecting (UnitLostError while it is lost)."""
        return self._owner._run(self.unit, (), "incarnation", lambda chan: chan.incarnation)

    def close(self) -> None:
        """Nothing to do: the connection belongs to :class:`UnitClients`."""

    def _live(self):
        """The transport channel, connected if need be; None while the unit is lost."""
        try:
            return self._owner._transport_channel(self.unit, (), "connect")
        except UnitLostError:
            return None

    def __repr__(self) -> str:
        return f"UnitChannel({self.unit!r})"


class UnitClients(Closeable):
    """Lazily connected channels to every unit of a membership, with loss detection.

    Parameters
    ----------
    membership:
        Unit name -> the address its server published (small dict).
    config:
        Supplies the token, the requested transport, the frame limit,
        ``heartbeat_interval_s`` and ``probe_timeout_s``.
    reprobe:
        Ping lost units in a background thread every ``heartbeat_interval_s``
        (the controller turns this off: its heartbeat pings every unit).
    """

    def __init__(self, membership: Mapping[str, dict], config: GputqConfig, *, reprobe: bool = True):
        if not config.token:
            raise ConfigError("a transport token is required to talk to StorageUnits")
        self._membership = dict(membership)
        self._config = config
        self._reprobe = reprobe
        self._channels: dict = {}
        self._handles = {unit: UnitChannel(self, unit) for unit in self._membership}
        self._choices: dict[str, tuple[str, str]] = {}
        self._connecting = {unit: threading.Lock() for unit in self._membership}
        self._lost: dict[str, tuple[str, float]] = {}  # unit -> (reason, monotonic time marked)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._closed = False

    @property
    def units(self) -> list[str]:
        """The whole membership, lost units included (references name any of them)."""
        return sorted(self._membership)

    @property
    def live_units(self) -> list[str]:
        """The membership minus units marked lost: where new keys go."""
        with self._lock:
            return sorted(u for u in self._membership if u not in self._lost)

    @property
    def lost(self) -> dict[str, str]:
        """Units marked lost -> the failure that marked them."""
        with self._lock:
            return {unit: reason for unit, (reason, _) in self._lost.items()}

    @property
    def membership(self) -> dict[str, dict]:
        return dict(self._membership)

    @property
    def config(self) -> GputqConfig:
        return self._config

    def transport_of(self, unit: str) -> tuple[str, str]:
        """(transport name, reason) chosen for ``unit`` (from its address; no connection needed)."""
        with self._lock:
            choice = self._choices.get(unit)
        if choice is None:
            choice = choose_transport(self._config.transport, self._address(unit))
            with self._lock:
                choice = self._choices.setdefault(unit, choice)
        return choice

    def channel(self, unit: str) -> UnitChannel:
        """The channel to ``unit``; connects now if the unit is live and not yet connected.

        A unit that cannot be reached is marked lost rather than raising
        here: the request made on the channel raises, naming its keys.
        """
        self._address(unit)
        handle = self._handles[unit]
        try:
            self._transport_channel(unit, (), "connect")
        except UnitLostError:
            pass
        return handle

    def mark_lost(self, unit: str, reason: str) -> None:
        """Mark ``unit`` lost: close its channel and fail its requests fast until a probe reaches it.

        Idempotent; the first reason is kept.
        """
        self._address(unit)
        with self._lock:
            if unit in self._lost or self._closed:
                return
            self._lost[unit] = (reason, time.monotonic())
            chan = self._channels.pop(unit, None)
            if self._reprobe and self._prober is None:
                self._prober = threading.Thread(target=self._probe_loop, name="gputq-unit-probe", daemon=True)
                self._prober.start()
        log.warning("StorageUnit %s marked lost: %s", unit, reason)
        if chan is not None:
            chan.abandon()  # requests in flight on it end now, not at their own timeouts; nothing more is sent

    def ping(self, unit: str, timeout: float | None = None) -> bool:
        """Probe ``unit`` with one cheap control call; True when it answered.

        A live unit that does not answer is marked lost; a lost unit that
        answers (on a fresh channel) is re-admitted.
        """
        timeout = self._config.probe_timeout_s if timeout is None else timeout
        self._address(unit)
        with self._lock:
            lost = unit in self._lost
        if not lost:
            try:
                self._run(unit, (), "ping", lambda chan: chan.call(PING_METHOD, timeout=timeout, keys=[]),
                          connect_timeout=timeout)
            except GputqError:
                return False
            return True
        with self._connecting[unit]:
            with self._lock:
                if self._closed:
                    return False
                if unit not in self._lost:
                    return True  # re-admitted meanwhile
            try:
                chan, choice = _connect(self._address(unit), self._config, timeout)
            except GputqError:
                return False
            try:
                chan.call(PING_METHOD, timeout=timeout, keys=[])
            except GputqError:
                chan.close()
                return False
            with self._lock:
                if self._closed:
                    chan.close()
                    return False
                reason, since = self._lost.pop(unit)
                self._channels[unit] = chan
                self._choices[unit] = choice
        log.warning("StorageUnit %s answers again after %.1f s lost (%s); re-admitted",
                    unit, time.monotonic() - since, reason)
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        self._stop.set()
        for chan in channels:
            chan.close()

    # -- internals ---------------------------------------------------------
    def _address(self, unit: str) -> dict:
        try:
            return self._membership[unit]
        except KeyError:
            raise InvalidInputError(f"unknown StorageUnit {unit!r}; members: {self.units}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("UnitClients is closed")

    def _lost_error(self, unit: str, keys: Sequence[str], what: str,
                    cause: BaseException | None = None) -> UnitLostError:
        with self._lock:
            reason, since = self._lost.get(unit, (f"{type(cause).__name__}: {cause}", time.monotonic()))
        keys = list(keys)
        shown = f"; {len(keys)} key(s) not served: {keys[:_KEYS_SHOWN]}{' ...' if len(keys) > _KEYS_SHOWN else ''}" \
            if keys else ""
        message = (f"unit {unit} is lost ({reason}; {time.monotonic() - since:.1f} s ago): "
                   f"{what} not served{shown}")
        cls = UnitTimeoutError if isinstance(cause, GputqTimeoutError) else UnitLostError
        return cls(message, unit=unit, keys=keys, reason=reason)

    def _connected(self, unit: str, keys: Sequence[str], what: str):
        """The transport channel of ``unit`` if one is open, else None; UnitLostError while it is lost."""
        with self._lock:
            self._check_open()
            lost = unit in self._lost
            chan = self._channels.get(unit)
        if lost:
            raise self._lost_error(unit, keys, what)
        return chan

    def _transport_channel(self, unit: str, keys: Sequence[str], what: str, connect_timeout: float | None = None):
        """The live transport channel of ``unit``, connected if need be; UnitLostError if lost."""
        chan = self._connected(unit, keys, what)
        if chan is not None:
            return chan
        address = self._address(unit)
        # Connect outside the shared lock: a slow unit must not stall the others' channels.
        with self._connecting[unit]:
            chan = self._connected(unit, keys, what)  # another thread may have connected meanwhile
            if chan is not None:
                return chan
            try:
                chan, choice = _connect(address, self._config, self._config.control_timeout_s
                                        if connect_timeout is None else connect_timeout)
            except GputqError as exc:
                if not _is_loss(exc):
                    raise
                self.mark_lost(unit, f"connect: {type(exc).__name__}: {exc}")
                raise self._lost_error(unit, keys, what, exc) from exc
            with self._lock:
                if self._closed:
                    chan.close()
                    self._check_open()
                self._channels[unit] = chan
                self._choices[unit] = choice
            return chan

    def _run(self, unit: str, keys: Sequence[str], what: str, request: Callable[[Any], Any], *,
             connect_timeout: float | None = None) -> Any:
        """``request(channel)`` on the live transport channel of ``unit``, under :meth:`_guarded`."""
        chan = self._transport_channel(unit, keys, what, connect_timeout)
        return self._guarded(unit, keys, what, lambda: request(chan))

    def _guarded(self, unit: str, keys: Sequence[str], what: str, request: Callable[..., Any], *args) -> Any:
        """``request(*args)``; a lost peer or a timeout in it marks ``unit`` lost and raises UnitLostError."""
        try:
            return request(*args)
        except GputqError as exc:
            # A ClosedError here is the channel mark_lost closed under this request.
            lost_meanwhile = isinstance(exc, ClosedError) and not self._closed and unit in self.lost
            if not (_is_loss(exc) or lost_meanwhile):
                raise
            self.mark_lost(unit, f"{what}: {type(exc).__name__}: {exc}")
            raise self._lost_error(unit, keys, what, exc) from exc

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._config.heartbeat_interval_s):
            with self._lock:
                lost = sorted(self._lost)
                if not lost or self._closed:
                    self._prober = None
                    return
            for unit in lost:
                self.ping(unit)
        with self._lock:
            self._prober = None


def _connect(address: dict, config: GputqConfig, timeout: float | None):
    name, reason = choose_transport(config.transport, address)
    kwargs = dict(token=config.token, max_frame_bytes=config.max_frame_bytes, timeout=timeout)
    if name == "tcp" and address.get("transport") == "rdma":
        # An rdma unit also serves tcp (its control plane); take that lane when policy says tcp.
        address = address["control"]
    return get_transport(name).connect(address, **kwargs), (name, reason)
