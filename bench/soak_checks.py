"""The soak's invariants, as plain functions of what one iteration saw: each returns its violations.

``python -m bench.soak`` checks every one of them on every iteration and
stops at the first violation. They live apart from the loop so that a test
can hand each one exactly the evidence of a broken run and see it caught.

- :func:`wrong_samples`: every sample a trainer consumed digests to what the
  writer digested at write time;
- :func:`untyped_errors` and :func:`late_surface`: every failure a call
  reports is one of gputq's typed errors (a killed process surfaces as
  Ray's error for it), and each fault surfaces within its deadline;
- :func:`key_violations`: after a release the units hold exactly the live
  rollouts' keys, and no lease or reservation is left;
- :func:`drift`: once the faults have healed, every process is back at its
  baseline resident memory, descriptors and threads within the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Bounds", "wrong_samples", "untyped_errors", "late_surface", "key_violations", "drift", "LEFT_ON_UNITS"]

#: Unit counters that must read zero once an iteration is over.
LEFT_ON_UNITS = ("leases", "reservations", "writers_waiting")


@dataclass(frozen=True)
class Bounds:
    """How far a process may sit above its baseline once the faults have healed."""

    rss_bytes: int = 64 << 20
    fds: int = 8
    threads: int = 4


def wrong_samples(expected: list, consumed: dict) -> list:
    """Shard positions whose digest (``consumed``: position -> digest) differs from ``expected[position]``."""
    return sorted(i for i, got in consumed.items() if got != expected[i])


def untyped_errors(errors: list) -> list:
    """Violations for reported errors (``error_report`` dicts) that are not typed."""
    return [f"untyped error {e['type']}: {e['message']}" for e in errors if not e["typed"]]


def late_surface(kind: str, injected_at: float, surfaced_at: float | None, deadline_s: float | None) -> list:
    """A violation if fault ``kind`` did not surface within ``deadline_s`` of ``injected_at``
    (``None``: no deadline)."""
    if deadline_s is None:
        return []
    if surfaced_at is None:
        return [f"{kind} did not surface as a typed error within {deadline_s:.1f} s"]
    took = surfaced_at - injected_at
    return [f"{kind} surfaced after {took:.2f} s, past its {deadline_s:.1f} s deadline"] if took > deadline_s else []


def key_violations(report: dict, unit_stats: dict) -> list:
    """Violations in a controller invariant check (``Controller.check_invariants``) and the units' stats.

    ``report``: stored keys are held only by live rollouts and every key a
    live sample uses is stored; ``unit_stats``: unit -> its ``stats`` call.
    """
    found = list(report["violations"])
    found += [f"unit {unit} unreachable after the faults healed: {why}" for unit, why in report["unreachable"].items()]
    for unit, stats in sorted(unit_stats.items()):
        found += [f"unit {unit} holds {stats[name]} {name} after the iteration" for name in LEFT_ON_UNITS
                  if stats.get(name)]
    return found


def drift(name: str, baseline: dict, now: dict, bounds: Bounds) -> list:
    """Violations where process ``name`` sits above its ``baseline`` (``usage()`` dicts) beyond ``bounds``."""
    limits = {"rss": bounds.rss_bytes, "fds": bounds.fds, "threads": bounds.threads}
    return [f"{name}: {what} {now[what]} against a baseline of {baseline[what]} (bound +{limit})"
            for what, limit in limits.items() if now[what] - baseline[what] > limit]
