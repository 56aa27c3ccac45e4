"""Lifetimes of stored steps under asynchronous training and partial rollouts.

A stored key lives exactly as long as something references it. The
references are counted per partition (rollout) on the key's unit:

- a write holds one reference in the writing partition;
- :meth:`Writer.finalize <gputq.client.writer.Writer.finalize>` turns it into one
  reference per segment that uses the key;
- :func:`carry` moves a session's references to a later partition without
  moving bytes (a partial rollout: the session goes on in the next rollout);
- :func:`drop` gives back the references of segments nobody will train on
  (a filtered-out group); :meth:`Reader.release <gputq.client.reader.Reader.release>`
  those of consumed segments;
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
from gputq.errors import InvalidInputError

__all__ = ["uses_of", "keys_by_unit", "on_units", "carry", "drop"]


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


def _per_unit(clients, work: Mapping[str, Any], call, what: str) -> int:
    """Run ``call(channel, args)`` on each unit in parallel; total its counts (see :func:`tally`)."""
    return tally(fan_out(work, lambda unit: int(call(clients.channel(unit), work[unit]))), what, "done")["done"]


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

    Returns
    -------
    int
        Keys moved.

    Raises
    ------
    InvalidInputError
        ``from_partition`` holds no reference to some key (nothing moved on
        that unit).
    PartialFailureError
        Some units were unreachable; the others moved their keys.
    """
    timeout = clients.config.control_timeout_s if timeout is None else timeout
    work = keys_by_unit(what)
    return _per_unit(clients, work, lambda chan, keys: chan.call(
        "transfer", timeout=timeout, keys=keys, from_partition=str(from_partition),
        to_partition=str(to_partition)), f"carry {from_partition!r} -> {to_partition!r}")


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
        Some units were unreachable; the others released theirs.
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

    _per_unit(clients, work, short, f"drop from {partition!r}")
    extra = {} if release_id is None else {"release_id": release_id}
    return _per_unit(clients, work, lambda chan, keys: chan.call(
        "release", timeout=timeout, keys=keys, partition=partition, **extra), f"drop from {partition!r}")
