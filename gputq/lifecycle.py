"""Lifetimes of stored steps under asynchronous training and partial rollouts.

A stored key lives exactly as long as something references it. The
references are counted per partition (rollout) on the key's unit:

- a write holds one reference in the writing partition;
- :meth:`Writer.finalize <gputq.writer.Writer.finalize>` turns it into one
  reference per segment that uses the key;
- :func:`carry` moves a session's references to a later partition without
  moving bytes (a partial rollout: the session goes on in the next rollout);
- :func:`drop` gives back the references of segments nobody will train on
  (a filtered-out group); :meth:`Reader.release <gputq.reader.Reader.release>`
  those of consumed segments;
- ``Controller.release_partition`` drops whatever a rollout still holds.

:func:`uses_of` counts what a caller still holds, for
``Controller.check_invariants``. :func:`overlapping_rollouts` runs two
overlapping rollouts end to end (``gputq demo --overlap``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

import numpy as np

from .clients import fan_out, tally
from .errors import InvalidInputError
from .refs import FieldRef, Layout, uses_by_unit

__all__ = ["uses_of", "keys_by_unit", "on_units", "carry", "drop", "overlapping_rollouts", "blocking"]


def _samples(what: Any) -> Iterable[Mapping[str, Layout] | FieldRef]:
    """Flatten ``what`` into samples (mappings of field -> Layout) and bare refs."""
    from .trajectory import Segment, Session

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

    ``what`` is a :class:`~gputq.trajectory.Session` (each stored step once:
    its write reference), a :class:`~gputq.trajectory.Segment`, a sample
    (field name -> :class:`~gputq.refs.Layout`), a Layout, a
    :class:`~gputq.refs.FieldRef`, or any nesting of iterables of those.
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


# -- two overlapping rollouts (``gputq demo --overlap``) --------------------------------

class blocking:
    """A Ray actor handle whose methods return their result (``ray.get``), not an ObjectRef.

    Passes a remote :class:`~gputq.controller.Controller` where a plain one is expected.
    """

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name: str):
        from .deploy import import_ray

        method = getattr(self._handle, name)
        return lambda *args, **kwargs: import_ray().get(method.remote(*args, **kwargs))


def _continue(session, writer, partition: str, rng: np.random.Generator, layers: int, topk: int,
              experts: int, tokens: int):
    """One more model call of ``session``, stored in ``partition`` (the session went on)."""
    tool = rng.integers(0, 32000, max(1, tokens // 8), dtype=np.int32)
    prompt = np.concatenate([session.context, tool])
    output = rng.integers(0, 32000, tokens, dtype=np.int32)
    start = session.steps[-1].seqlen - 1  # synthetic sessions end on a step of the current context
    arrays = {"logprobs": -rng.exponential(1.0, tokens).astype(np.float32),
              "routed_experts": rng.integers(0, experts, (len(prompt) + tokens - 1 - start, layers, topk),
                                             dtype=np.int32)}
    key = f"{partition}/carried/{session.session_id}/{len(session.steps)}"  # apart from the rollout's own
    session.append_step(prompt, output, arrays=arrays, refs=writer.put(key, partition, arrays))


def _families(sessions) -> list[list]:
    """Sessions grouped with their branches (which share their prefix steps)."""
    groups: dict[str, list] = {}
    for session in sessions:
        groups.setdefault(session.session_id.split(".")[0], []).append(session)
    return list(groups.values())


def _consume(reader, segments, partition: str) -> list[str]:
    """Fetch, compare with the inline path, release; returns the ids that differ."""
    from .trajectory import inline_fields

    shard = [seg.layouts for seg in segments]
    restored = reader.fetch(shard)
    bad = [seg.segment_id for seg, got in zip(segments, restored)
           if any(not np.array_equal(np.asarray(got[name]), want) or np.asarray(got[name]).dtype != want.dtype
                  for name, want in inline_fields(seg).items())]
    reader.release(shard, partition)
    return bad


def overlapping_rollouts(controller, clients, config, *, sessions: int = 6, steps: int = 3, layers: int = 4,
                         topk: int = 2, experts: int = 64, tokens: int = 48, seed: int = 0) -> dict:
    """Two overlapping rollouts with carried sessions and filtered groups, checked end to end.

    Rollout ``overlap-0`` writes ``sessions`` sessions (branches and
    context rewrites included), grouped with their branches. One group is
    unfinished: it is carried to ``overlap-1``, where it goes on for one
    more step. One group is filtered out (dropped). ``overlap-1`` starts
    writing before ``overlap-0``'s samples are consumed (asynchronous
    training); ``overlap-0`` is released while ``overlap-1`` is live, which
    must not touch the carried steps. ``overlap-1`` then filters a group
    of its own, consumes the rest and is released.

    ``controller`` needs ``open_partition``, ``release_partition``,
    ``check_invariants`` and ``stats`` (a :class:`~gputq.controller.Controller`,
    or a blocking wrapper of its Ray actor). Returns a summary; ``verified``
    is true when every consumed sample was bit-exact, the invariants held
    after each release, and the arena ended empty.
    """
    from .fields import FieldRegistry
    from .reader import Reader
    from .synthetic import SyntheticConfig, build_sessions
    from .trajectory import lineage_segments
    from .writer import Writer

    if sessions < 3:
        raise InvalidInputError("overlapping_rollouts needs at least 3 sessions (carried, dropped, consumed)")
    r0, r1 = "overlap-0", "overlap-1"
    fields = FieldRegistry.builtin(layers, topk, config.routed_experts_dtype)
    rng = np.random.default_rng([seed, 1])
    synth = dict(steps_per_session=steps, layers=layers, topk=topk, num_experts=experts,
                 prompt_tokens=tokens, tokens_per_step=tokens, tool_tokens=max(1, tokens // 8),
                 branch_prob=0.3, rewrite_prob=0.2)
    summary: dict[str, Any] = {"mismatched": [], "invariants": []}

    def segments_of(group):
        return [seg for session in group for seg in lineage_segments(session)]

    def check(referenced, when):
        report = controller.check_invariants(referenced)
        summary["invariants"].append({"after": when, "ok": report["ok"], "violations": report["violations"][:5]})

    with Writer(clients, config) as writer, Reader(clients, config) as reader:
        controller.open_partition(r0)
        first = _families(build_sessions(SyntheticConfig(sessions=sessions, seed=seed, **synth), fields=fields,
                                         writer=writer, partition=r0))
        writer.flush()
        carried, dropped0, kept0 = first[0], first[1], [s for g in first[2:] for s in g]
        controller.open_partition(r1)
        summary["keys_carried"] = carry(carried, r0, r1, clients)
        done0 = segments_of(kept0) + segments_of(dropped0)
        writer.finalize([seg.layouts for seg in done0], r0)
        summary["keys_freed_by_drop"] = drop([seg.layouts for seg in segments_of(dropped0)], r0, clients)
        # Rollout 1 is under way before rollout 0's samples are trained on.
        second = _families(build_sessions(SyntheticConfig(sessions=max(2, sessions // 2), seed=seed + 1, **synth),
                                          fields=fields, writer=writer, partition=r1))
        for session in carried:
            _continue(session, writer, r1, rng, layers, topk, experts, tokens)
        writer.flush()
        summary["mismatched"] += _consume(reader, segments_of(kept0), r0)
        summary["released_0"] = controller.release_partition(r0)
        check([carried, second], f"release of {r0}")
        dropped1, kept1 = second[0], [s for g in second[1:] for s in g] + carried
        done1 = segments_of(kept1) + segments_of(dropped1)
        writer.finalize([seg.layouts for seg in done1], r1)
        summary["keys_freed_by_drop"] += drop([seg.layouts for seg in segments_of(dropped1)], r1, clients)
        summary["mismatched"] += _consume(reader, segments_of(kept1), r1)
        summary["released_1"] = controller.release_partition(r1)
        check([], f"release of {r1}")
    totals = controller.stats()["totals"]
    summary.update(segments_consumed=len(segments_of(kept0)) + len(segments_of(kept1)),
                   segments_dropped=len(segments_of(dropped0)) + len(segments_of(dropped1)),
                   sessions_carried=len(carried), keys_left=int(totals["keys"]), bytes_left=int(totals["used"]))
    summary["verified"] = (not summary["mismatched"] and all(c["ok"] for c in summary["invariants"])
                           and summary["keys_left"] == 0 and summary["bytes_left"] == 0)
    return summary
