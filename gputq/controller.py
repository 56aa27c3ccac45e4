"""The controller: membership, partitions, lifecycle and aggregated stats.

It is never on the per-byte path: writers learn the membership once and
place keys themselves (rendezvous hashing); readers go to units directly.
The controller only answers "which units exist" and fans lifecycle calls
(release a rollout, move keys between rollouts) out to the units.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable

from .clients import UnitClients
from .config import GputqConfig
from .errors import InvalidInputError

__all__ = ["Controller"]


class Controller:
    """Membership and lifecycle of one deployment (plain Python; Ray wraps it).

    Parameters
    ----------
    config:
        Supplies the token and timeouts used to reach the units.
    """

    def __init__(self, config: GputqConfig):
        self._config = config
        self._lock = threading.Lock()
        self._units: dict[str, dict] = {}
        self._nodes: dict[str, str | None] = {}
        self._partitions: dict[str, float] = {}
        self._clients: UnitClients | None = None

    @property
    def config(self) -> GputqConfig:
        return self._config

    # -- membership ------------------------------------------------------
    def register_unit(self, name: str, address: dict, node_id: str | None = None) -> None:
        """Add (or re-add) a unit; writers created afterwards place keys on it."""
        with self._lock:
            self._units[name] = dict(address)
            self._nodes[name] = node_id
            self._reset_clients()

    def deregister_unit(self, name: str) -> None:
        with self._lock:
            if self._units.pop(name, None) is None:
                raise InvalidInputError(f"unknown StorageUnit {name!r}")
            self._nodes.pop(name, None)
            self._reset_clients()

    def membership(self) -> dict[str, dict]:
        """Unit name -> address, for building :class:`UnitClients`."""
        with self._lock:
            return {name: dict(addr) for name, addr in self._units.items()}

    def nodes(self) -> dict[str, str | None]:
        with self._lock:
            return dict(self._nodes)

    def _reset_clients(self) -> None:
        if self._clients is not None:
            self._clients.close()
        self._clients = None

    def _channels(self) -> UnitClients:
        with self._lock:
            if self._clients is None:
                self._clients = UnitClients(self._units, self._config)
            return self._clients

    # -- partitions ------------------------------------------------------
    def open_partition(self, partition: str) -> None:
        """Record a rollout as live (idempotent)."""
        with self._lock:
            self._partitions.setdefault(partition, time.time())

    def partitions(self) -> list[str]:
        with self._lock:
            return sorted(self._partitions)

    def release_partition(self, partition: str) -> int:
        """Drop every reference ``partition`` holds on every unit; returns keys freed."""
        clients = self._channels()
        freed = sum(int(clients.channel(unit).call(
            "release_partition", timeout=self._config.control_timeout_s, partition=partition))
            for unit in clients.units)
        with self._lock:
            self._partitions.pop(partition, None)
        return freed

    def transfer(self, keys_by_unit: dict[str, Iterable[str]], from_partition: str,
                 to_partition: str) -> None:
        """Move keys to another rollout (partial rollout); no bytes move."""
        self.open_partition(to_partition)
        clients = self._channels()
        for unit, keys in keys_by_unit.items():
            clients.channel(unit).call("transfer", timeout=self._config.control_timeout_s,
                                       keys=sorted(keys), from_partition=from_partition,
                                       to_partition=to_partition)

    # -- stats -----------------------------------------------------------
    def stats(self) -> dict:
        """Per-unit stats and cluster totals."""
        clients = self._channels()
        per_unit = {unit: clients.channel(unit).call("stats", timeout=self._config.control_timeout_s)
                    for unit in clients.units}
        totals = {name: sum(int(s.get(name, 0)) for s in per_unit.values())
                  for name in ("capacity", "used", "free", "keys")}
        return {"units": per_unit, "totals": totals, "partitions": self.partitions()}

    def close(self) -> None:
        with self._lock:
            self._reset_clients()
