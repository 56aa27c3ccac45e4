"""Lifetimes of stored steps under asynchronous training and partial rollouts.

A stored key lives exactly as long as something references it. The
references are counted per partition (rollout) on the key's unit:

- a write holds one reference in the writing partition;
- :meth:`Writer.finalize <gputq.client.writer.Writer.finalize>` turns it into one
  reference per segment that uses the key;
- :func:`carry` moves a session's references to a later partition without
  moving bytes (a partial rollout: the session goes on in the next rollout);
  :func:`transfer` does it for keys listed per unit (``Controller.transfer``);
- :func:`drop` gives back the references of segments nobody will train on
  (a filtered-out group); :meth:`Reader.release <gputq.client.reader.Reader.release>`
  those of consumed segments (both through :func:`release`);
- ``Controller.release_partition`` drops whatever a rollout still holds.

:func:`uses_of` counts what a caller still holds, for
``Controller.check_invariants``. The demo scenario that exercises all of
this end to end is :func:`gputq.tools.scenarios.overlapping_rollouts`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

from gputq.client.fanout import fan_out, tally
from gputq.data.refs import FieldRef, Layout, uses_by_unit
from gputq.data.trajectory import Segment, Session
from gputq.errors import InvalidInputError, UnitLostError

__all__ = ["uses_of", "keys_by_unit", "on_units", "carry", "transfer", "drop", "release"]


def _samples(what: Any) -> Iterable[Mapping[str, Layout] | FieldRef]:
    """Flatten ``what`` into samples (mappings of field -> Layout) and bare refs."""
    if isinstance(what, FieldRef):
        yield what
    elif isinstance(what, Layout):
        yield {what.field: what}
    elif isinstance(what, Segment):
        yield what.layouts
    elif isinstance(what, Session):
        yield from (ref for step in what.steps for ref in step.refs.values())
    elif isinstance(what, Mapping):
        if not all(isinstance(v, Layout) for v in what.values()):
            raise InvalidInputError("a mapping must be a sample: field name -> Layout")
        yield what
    elif isinstance(what, Iterable) and not isinstance(what, (str, bytes)):
        for item in what:
            yield from _samples(item)
    else:
        raise InvalidInputError(f"cannot find references in a {type(what).__name__}")


def uses_of(what: Any) -> Counter:
    """Live uses per ``(unit, key)``: one per sample (segment) using the key, one per bare ref.

    ``what`` is a :class:`~gputq.data.trajectory.Session` (each stored step once:
    its write reference), a :class:`~gputq.data.trajectory.Segment`, a sample
    (field name -> :class:`~gputq.data.refs.Layout`), a Layout, a
    :class:`~gputq.data.refs.FieldRef`, or any nesting of iterables of those.
    A step shared by sessions (a branch's prefix) counts once.
    """
    uses: Counter = Counter()
    refs: set[tuple[str, str]] = set()
    for item in _samples(what):
        if isinstance(item, FieldRef):
            refs.add((item.unit, item.key))
        else:
            for unit, keys in uses_by_unit([item]).items():
                uses.update((unit, key) for key in keys)
    uses.update(refs)
    return uses


def keys_by_unit(what: Any) -> dict[str, list[str]]:
    """The distinct stored keys of ``what`` (see :func:`uses_of`), per unit, sorted."""
    out: dict[str, list[str]] = {}
    for unit, key in sorted(uses_of(what)):
        out.setdefault(unit, []).append(key)
    return out


def on_units(samples: Iterable[Mapping[str, Layout]], units: Iterable[str]) -> list[int]:
    """Indices of the samples whose every stored key is on one of ``units``.

    With ``clients.live_units`` these are the samples a reader can still
    fetch after a unit was lost; the others are skipped or regenerated.
    """
    units = set(units)
    return [i for i, sample in enumerate(samples)
            if all(ref.unit in units for layout in sample.values() for ref in layout.refs())]


def carry(what: Any, from_partition: str, to_partition: str, clients, *,
          timeout: float | None = None) -> int:
    """Move the references ``from_partition`` holds on the keys of ``what`` to ``to_partition``.

    No bytes move. Use it for a session (or its segments) that goes on in
    a later rollout: releasing ``from_partition`` afterwards leaves those
    keys alive, and ``to_partition`` now owns them (finalize, release and
    drop them there). Every reference of ``from_partition`` on those keys
    moves, so carry whole sessions, with their branches. Open
    ``to_partition`` on the controller first, or ``check_invariants`` will
    not count it as live.

    Returns the keys moved; raises as :func:`transfer` does.
    """
    return transfer(keys_by_unit(what), from_partition, to_partition, clients, timeout=timeout)


def transfer(by_unit: Mapping[str, Iterable[str]], from_partition: str, to_partition: str, clients, *,
             timeout: float | None = None) -> int:
    """:func:`carry` for keys listed per unit: unit -> its keys (repeats and empty lists are fine).

    Every unit is asked in parallel; a lost one does not keep the others
    from moving theirs.

    Returns
    -------
    int
        Keys moved.

    Raises
    ------
    InvalidInputError
        ``from_partition`` holds no reference to some key (nothing moved on
        that unit), or a unit is not a member; raised after the other units
        moved theirs.
    PartialFailureError
        Some units were unreachable; the others moved their keys
        (``.result``: ``{"moved", "unreachable"}``).
    """
    timeout = clients.config.control_timeout_s if timeout is None else timeout
    work = {unit: sorted(set(keys)) for unit, keys in by_unit.items() if keys}
    done = fan_out(work, lambda unit: int(clients.channel(unit).call(
        "transfer", timeout=timeout, keys=work[unit], from_partition=str(from_partition),
        to_partition=str(to_partition))))
    return tally(done, f"transfer {from_partition!r} -> {to_partition!r}", "moved")["moved"]


def drop(samples: Iterable[Mapping[str, Layout]], partition: str, clients, *,
         release_id: str | None = None, timeout: float | None = None) -> int:
    """Give back the references of segments nobody will train on; returns keys freed.

    One reference of ``partition`` per sample and key, the count
    :meth:`Writer.finalize` gave them: a key is freed only when no other
    live segment uses it. Strict: every unit is asked first whether
    ``partition`` holds that many references, and nothing is released
    anywhere if one does not (a second drop of the same samples raises
    instead of eating other segments' references). ``release_id`` makes a
    retry a no-op on units that support it.

    Raises
    ------
    UnknownKeyError
        A key is no longer stored.
    InvalidInputError
        ``partition`` holds fewer references to a key than the samples use.
    PartialFailureError
        Some units were unreachable (when asked or when released); the
        others released theirs. ``.result``: ``{"freed", "unreachable"}``.
    """
    timeout = clients.config.control_timeout_s if timeout is None else timeout
    work = uses_by_unit(list(samples))
    partition = str(partition)

    def short(chan, keys) -> int:
        wanted = Counter(keys)
        for entry in chan.call("lookup", timeout=timeout, keys=sorted(wanted)):
            held = int(entry["holders"].get(partition, 0))
            if held < wanted[entry["key"]]:
                raise InvalidInputError(f"unit {chan.unit}: partition {partition!r} holds {held} reference(s) "
                                        f"to key {entry['key']!r}; cannot drop {wanted[entry['key']]}")
        return 0

    checked = fan_out(work, lambda unit: short(clients.channel(unit), work[unit]))
    for unit in sorted(checked):  # a unit's own answer: a reference is missing, release nothing
        if isinstance(checked[unit], BaseException) and not isinstance(checked[unit], UnitLostError):
            raise checked[unit]
    # A unit the check did not reach is reported as unreachable; the others release theirs.
    reached = {unit: keys for unit, keys in work.items() if not isinstance(checked[unit], BaseException)}
    done = {**checked, **_released(reached, partition, clients, release_id=release_id, timeout=timeout)}
    return tally(done, f"drop from {partition!r}", "freed")["freed"]


def release(uses: Mapping[str, Iterable[str]], partition: str, clients, *, missing_ok: bool = False,
            release_id: str | None = None, timeout: float | None = None, what: str | None = None) -> dict:
    """Drop one reference of ``partition`` per listed use (unit -> keys, a key once per use), in parallel.

    The one fan-out behind :func:`drop` and :meth:`Reader.release
    <gputq.client.reader.Reader.release>`. ``missing_ok`` skips keys no
    longer stored and references ``partition`` no longer holds;
    ``release_id`` makes a retry a no-op on each unit that applied it.

    Returns
    -------
    dict
        ``{"freed": keys freed, "unreachable": {}}``.

    Raises
    ------
    UnknownKeyError
        A key is no longer stored (unless ``missing_ok``).
    InvalidInputError
        ``partition`` holds fewer references to a key than listed (unless
        ``missing_ok``).
    PartialFailureError
        Some units were unreachable; raised after every other unit released
        its keys, with ``{"freed", "unreachable": {unit: reason}}`` as ``.result``.
    """
    done = _released(uses, partition, clients, missing_ok=missing_ok, release_id=release_id, timeout=timeout)
    return tally(done, what or f"release from {partition!r}", "freed")


def _released(uses: Mapping[str, Iterable[str]], partition: str, clients, *, missing_ok: bool = False,
              release_id: str | None = None, timeout: float | None = None) -> dict:
    """The fan-out of :func:`release`: unit -> keys freed, or the error its call raised."""
    timeout = clients.config.control_timeout_s if timeout is None else timeout
    partition = str(partition)
    extra = {"missing_ok": True} if missing_ok else {}
    if release_id is not None:
        extra["release_id"] = release_id
    work = {unit: list(keys) for unit, keys in uses.items()}
    return fan_out(work, lambda unit: int(clients.channel(unit).call(
        "release", timeout=timeout, keys=work[unit], partition=partition, **extra)))
