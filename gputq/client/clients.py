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
pings the lost units every ``heartbeat_interval_s``, in parallel (a hung
one's probe holds up no other's return); the controller pings every unit on
the same beat. Re-admitting is safe because references name
their unit: a unit that was only stalled still holds its keys, and one that
restarted answers reads of its old keys with typed errors of its own.
:attr:`UnitClients.live_units` (the membership minus lost units) is where
new keys are placed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

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
from gputq.client.unit_channel import UnitAccess, UnitChannel
from gputq.transport import get_transport
from gputq.transport.base import Closeable
from gputq.transport.policy import choose_transport

__all__ = ["UnitClients", "PING_METHOD"]

log = logging.getLogger(__name__)

#: The control call a probe makes: every unit answers it, and it touches no key.
PING_METHOD = "lookup"
_KEYS_SHOWN = 8


def _is_loss(exc: BaseException) -> bool:
    """True when ``exc`` means the unit did not answer (not a typed answer from it)."""
    return (isinstance(exc, (PeerLostError, GputqTimeoutError))
            and not isinstance(exc, (CapacityError, UnitBusyError, UnitLostError)))


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
        access = UnitAccess(self._run, self._guarded, lambda unit: self._transport_channel(unit, (), "connect"))
        self._handles = {unit: UnitChannel(access, unit) for unit in self._membership}
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
        """``request(*args)``; a lost peer or a timeout in it marks ``unit`` lost and raises UnitLostError.
        Once these clients are closed, whatever the request raised is ``ClosedError``: it failed because
        its channel was closed under it (a lost connection, NIXL's dropped agent), not the unit."""
        try:
            return request(*args)
        except GputqError as exc:
            if self._closed and not isinstance(exc, ClosedError):
                raise ClosedError(f"UnitClients was closed during a {what} on unit {unit}") from exc
            # A ClosedError here is the channel mark_lost closed under this request.
            lost_meanwhile = isinstance(exc, ClosedError) and not self._closed and unit in self.lost
            if not (_is_loss(exc) or lost_meanwhile):
                raise
            self.mark_lost(unit, f"{what}: {type(exc).__name__}: {exc}")
            raise self._lost_error(unit, keys, what, exc) from exc

    def _probe_loop(self) -> None:
        """Probe every lost unit each heartbeat, each on a thread of its own that the beat does not wait for:
        a hung unit's probe (up to ``probe_timeout_s``) holds up neither another unit's probe nor the next
        beat's probe of a unit lost meanwhile. A unit whose probe is still under way is not probed again."""
        probing: dict[str, threading.Thread] = {}
        while not self._stop.wait(self._config.heartbeat_interval_s):
            with self._lock:
                lost = sorted(self._lost)
                if not lost or self._closed:
                    self._prober = None
                    return
            for unit in lost:
                if unit not in probing or not probing[unit].is_alive():
                    probing[unit] = threading.Thread(target=self.ping, args=(unit,), name=f"gputq-probe-{unit}",
                                                     daemon=True)
                    probing[unit].start()
        with self._lock:
            self._prober = None


def _connect(address: dict, config: GputqConfig, timeout: float | None):
    name, reason = choose_transport(config.transport, address)
    kwargs = dict(token=config.token, max_frame_bytes=config.max_frame_bytes, timeout=timeout)
    if name == "tcp" and address.get("transport") == "rdma":
        # An rdma unit also serves tcp (its control plane); take that lane when policy says tcp.
        address = address["control"]
    return get_transport(name).connect(address, **kwargs), (name, reason)
