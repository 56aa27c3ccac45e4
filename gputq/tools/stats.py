"""``gputq stats``: the units of a running deployment as a live table, read over Ray.

It attaches to the controller actor by name (:mod:`gputq.cluster.names`),
asks every unit's actor for its stats and prints one line per unit, with
rates between refreshes; ``--once``/``--json`` print one snapshot and
``--check`` adds the controller's invariant check (exit 1 on a violation).
"""

from __future__ import annotations

import json
import socket
import sys
import time

from gputq.cluster.names import CONTROLLER_NAME, NAMESPACE, import_ray, unit_actor_name
from gputq.errors import GputqTimeoutError, InvalidInputError

__all__ = ["format_table", "run_stats"]


_COLUMNS = (("unit", "name", 24), ("held MiB", "used", 10), ("cap MiB", "capacity", 9), ("keys", "keys", 8),
            ("leases", "leases", 7), ("writes/s", "puts", 9), ("reads/s", "reads", 9),
            ("MB in/s", "bytes_written", 9), ("MB out/s", "bytes_read", 9), ("waits", "waits", 7),
            ("expired", "leases_expired", 8), ("errors", "capacity_errors", 7), ("RSS MiB", "rss_bytes", 8))
_RATES = {"puts", "reads", "bytes_written", "bytes_read"}


def format_table(units: dict[str, dict], previous: dict[str, dict] | None = None, seconds: float = 0.0) -> str:
    """One line per unit; rates from ``previous`` over ``seconds`` (totals when there is none)."""
    header = " ".join(title.rjust(width) if i else title.ljust(width)
                      for i, (title, _, width) in enumerate(_COLUMNS))
    lines = [header]
    for name, stats in sorted(units.items()):
        if "error" in stats:
            lines.append(f"{name.ljust(24)} unreachable: {stats['error']}")
            continue
        cells = [name[:24].ljust(24)]
        for _, key, width in _COLUMNS[1:]:
            value = float(stats.get(key, 0))
            if key in _RATES and previous and name in previous and seconds > 0:
                value = (value - float(previous[name].get(key, 0))) / seconds
            if key in ("used", "capacity", "rss_bytes"):
                value /= 1 << 20
            elif key in ("bytes_written", "bytes_read"):
                value /= 1e6
            counted = key not in _RATES and key not in ("used", "capacity", "rss_bytes")
            cells.append((f"{int(value)}" if counted else f"{value:.1f}").rjust(width))
        lines.append(" ".join(cells))
    return "\n".join(lines)


#: How long ``gputq stats`` tries to reach an explicit ``--address`` before giving up.
CONNECT_TIMEOUT_S = 10.0
#: How long it waits for the controller's answer to one call (the invariant check: ``CHECK_TIMEOUT_S``) or a
#: unit's stats: a hung actor is an error line, not a hang of the tool an operator debugs it with.
ANSWER_TIMEOUT_S = 30.0
CHECK_TIMEOUT_S = 120.0


def _ask(ray, call, what: str, timeout: float | None = None):
    """``ray.get(call)`` within ``timeout`` (default ``ANSWER_TIMEOUT_S``), else ``GputqTimeoutError``."""
    timeout = ANSWER_TIMEOUT_S if timeout is None else timeout
    try:
        return ray.get(call, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise GputqTimeoutError(f"{what} did not answer within {timeout:g} s (a hung actor? `ray list actors "
                                f"--filter namespace={NAMESPACE}` shows its state)") from None


def _check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse an explicit ``host:port`` nothing listens on (Ray's own connect retries it for minutes)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith(("ray://", "auto")):
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise InvalidInputError(f"no Ray cluster at --address {address!r}: {exc}") from None


def _attach(address: str):
    ray = import_ray()
    if not ray.is_initialized():
        _check_reachable(address)
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        except ConnectionError as exc:
            raise InvalidInputError(f"no Ray cluster at --address {address!r}: {exc}") from None
    try:
        return ray, ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise InvalidInputError(f"no gputq deployment on this Ray cluster (no actor {CONTROLLER_NAME!r} "
                                     f"in namespace {NAMESPACE!r})") from None


def _unit_stats(ray, controller) -> dict[str, dict]:
    out = {}
    for name in sorted(_ask(ray, controller.membership.remote(), "the controller's membership")):
        try:
            out[name] = _ask(ray, ray.get_actor(unit_actor_name(name), namespace=NAMESPACE).stats.remote(),
                             f"unit {name}'s stats")
        except Exception as exc:  # a lost unit is a row of the table, not the end of it
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:120]}
    return out


def run_stats(*, address: str = "auto", interval: float = 2.0, once: bool = False, as_json: bool = False,
              check: bool = False) -> int:
    """``gputq stats``: print the units' table (live, or once), optionally the invariant check."""
    ray, controller = _attach(address)
    units = _unit_stats(ray, controller)
    if as_json or once:
        partitions = _ask(ray, controller.partitions.remote(), "the controller's partitions")
        result = {"units": units, "partitions": partitions}
        status = 0
        if check:
            result["check"], status = _check(ray, controller)
        if as_json:
            print(json.dumps(result, default=str))
        else:
            print(format_table(units))
            print(f"partitions: {', '.join(result['partitions']) or '(none)'}")
            if check:
                print(_check_line(result["check"]))
        return status
    previous, last = units, time.monotonic()
    try:
        while True:
            time.sleep(interval)  # a refresh period, not a wait for an event
            units, now = _unit_stats(ray, controller), time.monotonic()
            sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n")
            print(format_table(units, previous, now - last), flush=True)
            previous, last = units, now
    except KeyboardInterrupt:
        return 0


def _check(ray, controller) -> tuple[dict, int]:
    try:
        report = _ask(ray, controller.check_invariants.remote(), "the controller's invariant check", CHECK_TIMEOUT_S)
    except AttributeError:
        return {"available": False, "reason": "this deployment's controller has no check_invariants"}, 0
    return {"available": True, **report}, 0 if report.get("ok") else 1


def _check_line(check: dict) -> str:
    if not check.get("available"):
        return f"invariant check unavailable: {check['reason']}"
    if check.get("ok"):
        return "invariant check: ok"
    return "invariant check: VIOLATIONS\n  " + "\n  ".join(map(str, check.get("violations", [])))
