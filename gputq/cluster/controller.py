"""The controller: membership, liveness, partitions, lifecycle and aggregated stats.

It is never on the per-byte path: writers learn the membership once and
place keys themselves (rendezvous hashing); readers go to units directly.
The controller answers "which units exist, and which are lost", fans
lifecycle calls (release a rollout, move keys between rollouts) out to the
units, and checks that what is stored is exactly what is referenced.

Liveness. A heartbeat thread pings every unit each
``config.heartbeat_interval_s`` (one cheap control call, all units in
parallel, each bounded by ``config.probe_timeout_s``). A killed unit is
marked lost within one interval, a hung one within one interval plus the
probe timeout. A lost unit that answers a later ping is re-admitted, and
the rollout releases it missed while lost are replayed on it, so a stalled
unit that comes back does not keep released keys.

Partial failure. Fan-out calls go to every unit in parallel; units that do
not answer are reported, with the reason, in the result, and
:class:`~gputq.errors.PartialFailureError` is raised only after every
reachable unit has done its part.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Iterable

from gputq.client.clients import UnitClients
from gputq.client.fanout import failures, fan_out, tally
from gputq.client.lifecycle import transfer, uses_of
from gputq.config import GputqConfig
from gputq.errors import GputqError, InvalidInputError, UnknownKeyError

__all__ = ["Controller"]

log = logging.getLogger(__name__)

_SHOWN = 5


class Controller:
    """Membership, liveness and lifecycle of one deployment (plain Python; Ray wraps it).

    Parameters
    ----------
    config:
        Supplies the token, the timeouts used to reach the units and the
        heartbeat interval.
    heartbeat:
        Run the heartbeat thread (started with the first registered unit).
        Off, liveness changes only when :meth:`heartbeat` is called.
    """

    def __init__(self, config: GputqConfig, *, heartbeat: bool = True):
        self._config = config
        self._lock = threading.Lock()
        self._units: dict[str, dict] = {}
        self._nodes: dict[str, str | None] = {}
        self._partitions: dict[str, float] = {}
        self._missed: dict[str, set[str]] = {}  # unit -> partitions released while it was lost
        self._clients: UnitClients | None = None
        self._carried_lost: dict[str, str] = {}  # lost marks kept across a membership change
        self._heartbeat_on = heartbeat
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def config(self) -> GputqConfig:
        return self._config

    # -- membership ------------------------------------------------------
    def register_unit(self, name: str, address: dict, node_id: str | None = None) -> None:
        """Add a unit; writers created afterwards place keys on it.

        Re-adding a name (a restarted unit, a new address) starts it afresh:
        it is live, and releases it missed are forgotten (its old keys are gone).
        """
        with self._lock:
            self._units[name] = dict(address)
            self._nodes[name] = node_id
            self._missed.pop(name, None)
            self._reset_clients(fresh=name)
            if self._heartbeat_on and self._beat is None and not self._stop.is_set():
                self._beat = threading.Thread(target=self._beat_loop, name="gputq-heartbeat", daemon=True)
                self._beat.start()

    def deregister_unit(self, name: str) -> None:
        with self._lock:
            if self._units.pop(name, None) is None:
                raise InvalidInputError(f"unknown StorageUnit {name!r}")
            self._nodes.pop(name, None)
            self._missed.pop(name, None)
            self._reset_clients(fresh=name)

    def membership(self) -> dict[str, dict]:
        """Unit name -> address, for building :class:`UnitClients` (lost units included)."""
        with self._lock:
            return {name: dict(addr) for name, addr in self._units.items()}

    def nodes(self) -> dict[str, str | None]:
        with self._lock:
            return dict(self._nodes)

    def lost_units(self) -> dict[str, str]:
        """Units marked lost -> the failure that marked them."""
        with self._lock:
            clients = self._clients
        return clients.lost if clients is not None else {}

    def live_units(self) -> list[str]:
        """The membership minus lost units."""
        lost = self.lost_units()
        return sorted(unit for unit in self.membership() if unit not in lost)

    def _reset_clients(self, fresh: str) -> None:
        """Drop the channels after a membership change; other units stay lost if they were."""
        if self._clients is None:
            return
        self._carried_lost = {u: r for u, r in self._clients.lost.items() if u != fresh and u in self._units}
        self._clients.close()
        self._clients = None

    def _channels(self) -> UnitClients:
        with self._lock:
            if self._clients is None:
                self._clients = UnitClients(self._units, self._config, reprobe=False)
                for unit, reason in self._carried_lost.items():
                    self._clients.mark_lost(unit, reason)
                self._carried_lost = {}
            return self._clients

    # -- liveness --------------------------------------------------------
    def heartbeat(self) -> dict[str, str]:
        """Ping every unit once, in parallel; replay missed releases on re-admitted units.

        Returns the units lost after this round (unit -> reason).
        """
        clients = self._channels()
        before = set(clients.lost)
        answered = fan_out(clients.units, lambda unit: clients.ping(unit))
        for unit in sorted(before):
            if answered.get(unit) is True:
                self._replay_missed(clients, unit)
        return clients.lost

    def _replay_missed(self, clients: UnitClients, unit: str) -> None:
        with self._lock:
            missed = sorted(self._missed.get(unit, ()))
        for partition in missed:
            try:
                freed = clients.channel(unit).call("release_partition", timeout=self._config.control_timeout_s,
                                                   partition=partition)
            except GputqError as exc:
                log.warning("unit %s: replaying the release of partition %r failed: %s", unit, partition, exc)
                return
            log.warning("unit %s is back: released partition %r it missed (%d keys freed)",
                        unit, partition, freed)
            with self._lock:
                self._missed.get(unit, set()).discard(partition)
                if not self._missed.get(unit, True):
                    del self._missed[unit]

    def _beat_loop(self) -> None:
        while not self._stop.wait(self._config.heartbeat_interval_s):
            try:
                self.heartbeat()
            except GputqError as exc:  # closed meanwhile, or a unit's odd answer: next beat retries
                log.debug("heartbeat: %s", exc)
            except RuntimeError as exc:  # the interpreter is shutting down (no new threads): stop beating
                log.debug("heartbeat stopped: %s", exc)
                return

    # -- partitions ------------------------------------------------------
    def open_partition(self, partition: str) -> None:
        """Record a rollout as live (idempotent)."""
        with self._lock:
            self._partitions.setdefault(str(partition), time.time())
            for missed in self._missed.values():  # a reused name must not be released by a replay
                missed.discard(str(partition))

    def partitions(self) -> list[str]:
        with self._lock:
            return sorted(self._partitions)

    def release_partition(self, partition: str) -> dict:
        """Drop every reference ``partition`` holds on every unit.

        Returns
        -------
        dict
            ``{"freed": keys freed, "unreachable": {unit: reason}}``.

        Raises
        ------
        PartialFailureError
            Some units were unreachable; raised after every other unit freed
            its keys, with the same dict as ``.result``. The release is
            replayed on those units when they answer again.
        """
        partition = str(partition)
        clients = self._channels()
        timeout = self._config.control_timeout_s
        done = fan_out(clients.units, lambda unit: int(clients.channel(unit).call(
            "release_partition", timeout=timeout, partition=partition)))
        with self._lock:
            self._partitions.pop(partition, None)
            for unit in failures(done):
                self._missed.setdefault(unit, set()).add(partition)
        return tally(done, f"release of partition {partition!r}", "freed", answers_raise=False)

    def transfer(self, keys_by_unit: dict[str, Iterable[str]], from_partition: str,
                 to_partition: str) -> int:
        """Move keys to another rollout (partial rollout); no bytes move. Returns keys moved.

        Opens ``to_partition``, then :func:`gputq.client.lifecycle.transfer`
        over this controller's channels. Raises :class:`PartialFailureError`
        (``.result``: ``{"moved", "unreachable"}``) after the other units
        moved theirs, if some unit could not be reached.
        """
        self.open_partition(to_partition)
        return transfer(keys_by_unit, from_partition, to_partition, self._channels(),
                        timeout=self._config.control_timeout_s)

    # -- invariants ------------------------------------------------------
    def check_invariants(self, referenced=None) -> dict:
        """Check that stored keys and live references agree.

        Every key stored on a reachable unit must be held by a live
        partition (one opened and not released), and, when ``referenced``
        is given, every key it uses must be stored with at least as many
        references as it has uses.

        Parameters
        ----------
        referenced:
            What the caller still holds: sessions, segments, samples
            (mappings of field name to Layout), layouts or FieldRefs, in
            any iterable (see :func:`gputq.client.lifecycle.uses_of`).

        Returns
        -------
        dict
            ``ok`` (no violation and every unit reachable), ``violations``
            (one sentence each), ``unreachable`` (unit -> reason),
            ``units_checked``, ``keys_checked``, ``bytes_checked``,
            ``partitions`` (the live ones) and ``method`` (``"keys"``, or
            ``"stats+lookup"`` with units that lack the ``keys`` call).
        """
        uses = uses_of(referenced) if referenced is not None else Counter()
        uses_on: dict[str, dict[str, int]] = {}
        for (unit, key), count in uses.items():
            uses_on.setdefault(unit, {})[key] = count
        live = set(self.partitions())
        clients = self._channels()
        timeout = self._config.control_timeout_s
        unknown_units = sorted(set(uses_on) - set(clients.units))
        reports = fan_out(clients.units, lambda unit: _check_unit(
            clients.channel(unit), unit, live, uses_on.get(unit, {}), timeout))
        unreachable = failures(reports)
        checked = [r for r in reports.values() if not isinstance(r, BaseException)]
        violations = [v for r in checked for v in r["violations"]]
        violations += [f"{sum(uses_on[u].values())} referenced key uses name unit {u}, not a member"
                       for u in unknown_units]
        return {"ok": not violations and not unreachable, "violations": violations,
                "unreachable": unreachable, "units_checked": len(checked),
                "keys_checked": sum(r["keys"] for r in checked),
                "bytes_checked": sum(r["bytes"] for r in checked),
                "partitions": sorted(live),
                "method": "+".join(sorted({r["method"] for r in checked})) or "none"}

    # -- stats -----------------------------------------------------------
    def stats(self) -> dict:
        """Per-unit stats and cluster totals; lost units are listed, not waited for."""
        clients = self._channels()
        timeout = self._config.control_timeout_s
        done = fan_out(clients.units, lambda unit: clients.channel(unit).call("stats", timeout=timeout))
        per_unit = {unit: s for unit, s in done.items() if not isinstance(s, BaseException)}
        totals = {name: sum(int(s.get(name, 0)) for s in per_unit.values())
                  for name in ("capacity", "used", "free", "keys")}
        return {"units": per_unit, "totals": totals, "partitions": self.partitions(),
                "unreachable": failures(done)}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._clients is not None:
                self._clients.close()
                self._clients = None


#: Keys per ``keys`` call: their names stay well inside one control frame.
_KEYS_PAGE = 4096


def _unit_keys(channel, timeout: float) -> dict[str, dict[str, int]]:
    """Every partition's keys and reference counts on one unit, read page by page."""
    table: dict[str, dict[str, int]] = {}
    after = None
    while True:
        page = channel.call("keys", timeout=timeout, after=after, limit=_KEYS_PAGE)
        for partition, keys in page["partitions"].items():
            table.setdefault(partition, {}).update(keys)
        after = page.get("next")
        if after is None:
            return table


def _check_unit(channel, unit: str, live: set[str], uses: dict[str, int], timeout: float) -> dict:
    """One unit's part of :meth:`Controller.check_invariants`."""
    violations: list[str] = []
    stats = channel.call("stats", timeout=timeout)
    try:
        table = _unit_keys(channel, timeout)
    except InvalidInputError:  # a unit without the ``keys`` call: partitions from stats, keys by lookup
        table = None
    if table is not None:
        holders: Counter = Counter()
        for partition, keys in table.items():
            for key, count in keys.items():
                holders[key] += int(count)
            if partition not in live and keys:
                violations.append(f"unit {unit} stores {len(keys)} keys of partition {partition!r}, which is "
                                  f"not live: {sorted(keys)[:_SHOWN]}")
        for key, count in sorted(uses.items()):
            if key not in holders:
                violations.append(f"key {key!r} on unit {unit} is referenced {count} times but not stored")
            elif holders[key] < count:
                violations.append(f"key {key!r} on unit {unit} has {holders[key]} references for {count} live uses")
        method = "keys"
    else:
        for partition, info in stats.get("partitions", {}).items():
            if partition not in live and info.get("keys"):
                violations.append(f"unit {unit} stores {info['keys']} keys ({info.get('bytes', 0)} bytes) of "
                                  f"partition {partition!r}, which is not live")
        for key, count in sorted(uses.items()):
            try:
                (entry,) = channel.call("lookup", timeout=timeout, keys=[key])
            except UnknownKeyError:
                violations.append(f"key {key!r} on unit {unit} is referenced {count} times but not stored")
                continue
            held = sum(int(c) for c in entry["holders"].values())
            if held < count:
                violations.append(f"key {key!r} on unit {unit} has {held} references for {count} live uses")
        method = "stats+lookup"
    return {"violations": violations, "keys": int(stats.get("keys", 0)), "bytes": int(stats.get("used", 0)),
            "method": method}
