"""Channels to the StorageUnits of one deployment, opened lazily and shared.

Writers, readers and the controller all talk to units through one
:class:`UnitClients`: it knows the membership (unit name -> address), picks
each pair's transport with the auto policy once, and keeps the channel.
"""

from __future__ import annotations

import threading
from typing import Mapping

from transport.base import Closeable

from .config import GputqConfig
from .errors import ClosedError, ConfigError, InvalidInputError

__all__ = ["UnitClients"]


class UnitClients(Closeable):
    """Lazily connected channels to every unit of a membership.

    Parameters
    ----------
    membership:
        Unit name -> the address its server published (small dict).
    config:
        Supplies the token, the requested transport and the frame limit.
    """

    def __init__(self, membership: Mapping[str, dict], config: GputqConfig):
        if not config.token:
            raise ConfigError("a transport token is required to talk to StorageUnits")
        self._membership = dict(membership)
        self._config = config
        self._channels: dict = {}
        self._choices: dict[str, tuple[str, str]] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def units(self) -> list[str]:
        return sorted(self._membership)

    @property
    def membership(self) -> dict[str, dict]:
        return dict(self._membership)

    def transport_of(self, unit: str) -> tuple[str, str]:
        """(transport name, reason) chosen for ``unit``; connects if needed."""
        self.channel(unit)
        return self._choices[unit]

    def channel(self, unit: str):
        """The channel to ``unit``, opened on first use."""
        with self._lock:
            self._check_open()
            chan = self._channels.get(unit)
            if chan is not None:
                return chan
            try:
                address = self._membership[unit]
            except KeyError:
                raise InvalidInputError(
                    f"unknown StorageUnit {unit!r}; members: {self.units}") from None
            connecting = self._connecting.setdefault(unit, threading.Lock())
        # Connect outside the shared lock: a slow unit must not stall the others' channels.
        with connecting:
            with self._lock:
                self._check_open()
                if unit in self._channels:
                    return self._channels[unit]
            chan, choice = _connect(address, self._config)
            with self._lock:
                if self._closed:
                    chan.close()
                    self._check_open()
                self._channels[unit] = chan
                self._choices[unit] = choice
            return chan

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("UnitClients is closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for chan in channels:
            chan.close()


def _connect(address: dict, config: GputqConfig):
    from transport import get_transport
    from transport.policy import choose_transport

    name, reason = choose_transport(config.transport, address)
    kwargs = dict(token=config.token, max_frame_bytes=config.max_frame_bytes,
                  timeout=config.control_timeout_s)
    if name == "tcp" and address.get("transport") == "rdma":
        # An rdma unit also serves tcp (its control plane); take that lane when policy says tcp.
        address = address["control"]
    return get_transport(name).connect(address, **kwargs), (name, reason)
