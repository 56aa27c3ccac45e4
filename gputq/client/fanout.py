"""Fan-out over units: one call per unit in parallel, and totals that name the units not reached.

Writers, readers, lifecycle operations and the controller all spread their
per-unit calls with :func:`fan_out`, so one slow or lost unit delays only
its own entry and the others' work is done; :func:`tally` then totals the
counts and raises :class:`~gputq.errors.PartialFailureError` naming the
units that were not reached.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

from gputq.errors import GputqError, PartialFailureError, UnitLostError

__all__ = ["fan_out", "failures", "tally"]


def fan_out(units: Iterable[str], task: Callable[[str], Any]) -> dict[str, Any]:
    """``task(unit)`` for every unit in parallel -> its result, or the GputqError it raised.

    One slow or lost unit delays only its own entry; nothing else waits for it.
    """
    units = list(units)
    if not units:
        return {}

    def guarded(unit):
        try:
            return task(unit)
        except GputqError as exc:
            return exc

    with ThreadPoolExecutor(len(units), thread_name_prefix="gputq-fanout") as pool:
        return dict(zip(units, pool.map(guarded, units)))


def failures(done: Mapping[str, Any]) -> dict[str, str]:
    """The units of a :func:`fan_out` whose task raised -> the error, as text."""
    return {unit: str(r) for unit, r in done.items() if isinstance(r, BaseException)}


def tally(done: Mapping[str, Any], what: str, count: str, *, answers_raise: bool = True) -> dict:
    """Total a :func:`fan_out` of counting calls; raise for the units it did not reach.

    Call it once the fan-out is over: every reachable unit has then done
    its part, whatever the others did.

    Parameters
    ----------
    done : dict
        What :func:`fan_out` returned: unit -> an int, or the error its call raised.
    what : str
        The operation, for the error message (``"release of partition 'r0'"``).
    count : str
        Name of the total in the result (``"freed"``, ``"moved"``).
    answers_raise : bool, optional
        Raise an error a unit answered with (anything but
        :class:`UnitLostError`): the unit is there, the caller's keys or
        partition are wrong. False counts every failure as unreachable.

    Returns
    -------
    dict
        ``{count: total over the units that answered, "unreachable": {}}``.

    Raises
    ------
    PartialFailureError
        Some units were not reached; ``.result`` is ``{count: total,
        "unreachable": {unit: reason}}`` and the message names the units.
    """
    if answers_raise:
        for unit in sorted(done):
            if isinstance(done[unit], BaseException) and not isinstance(done[unit], UnitLostError):
                raise done[unit]
    unreachable = failures(done)
    total = sum(int(r) for r in done.values() if not isinstance(r, BaseException))
    result = {count: total, "unreachable": unreachable}
    if unreachable:
        shown = "; ".join(f"{unit}: {reason}" for unit, reason in sorted(unreachable.items()))
        raise PartialFailureError(f"{what}: {total} keys {count} on {len(done) - len(unreachable)} units; "
                                  f"unreachable: {shown}", result)
    return result
