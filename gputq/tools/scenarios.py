"""Demo scenarios: two overlapping rollouts with carried sessions and filtered groups.

``gputq demo --overlap`` runs :func:`overlapping_rollouts` on a live
deployment; the tests run it on in-process units. It drives the lifetimes
of :mod:`gputq.client.lifecycle` with real writers and readers and checks
every consumed sample bit for bit against the inline path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gputq.client.lifecycle import carry, drop
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.cluster.names import import_ray
from gputq.data.fields import FieldRegistry
from gputq.data.trajectory import inline_fields, lineage_segments
from gputq.errors import InvalidInputError
from gputq.tools.synthetic import SyntheticConfig, build_sessions

__all__ = ["overlapping_rollouts", "blocking"]


class blocking:
    """A Ray actor handle whose methods return their result (``ray.get``), not an ObjectRef.

    Passes a remote :class:`~gputq.cluster.controller.Controller` where a plain one is expected.
    """

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name: str):
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
    ``check_invariants`` and ``stats`` (a :class:`~gputq.cluster.controller.Controller`,
    or a blocking wrapper of its Ray actor). Returns a summary; ``verified``
    is true when every consumed sample was bit-exact, the invariants held
    after each release, and the arena ended empty.
    """
    if sessions < 3:
        raise InvalidInputError("overlapping_rollouts needs at least 3 sessions (carried, dropped, consumed)")
    synth = dict(steps_per_session=steps, layers=layers, topk=topk, num_experts=experts,
                 prompt_tokens=tokens, tokens_per_step=tokens, tool_tokens=max(1, tokens // 8),
                 branch_prob=0.3, rewrite_prob=0.2)
    with Writer(clients, config) as writer, Reader(clients, config) as reader:
        fields = FieldRegistry.builtin(layers, topk, config.routed_experts_dtype)
        run = _Overlap(controller, clients, writer, reader, fields, synth,
                       {"mismatched": [], "invariants": [], "keys_freed_by_drop": 0})
        carried, dropped0, kept0 = run.first(sessions, seed)
        # Rollout 1 is under way before rollout 0's samples are trained on.
        second = run.rollout(_SECOND, max(2, sessions // 2), seed + 1)
        rng = np.random.default_rng([seed, 1])
        for session in carried:
            _continue(session, writer, _SECOND, rng, layers, topk, experts, tokens)
        writer.flush()
        run.consume(kept0, _FIRST)
        run.summary["released_0"] = controller.release_partition(_FIRST)
        run.check([carried, second], f"release of {_FIRST}")
        dropped1, kept1 = second[0], [s for g in second[1:] for s in g] + carried
        run.finish(kept1, dropped1, _SECOND)
        run.consume(kept1, _SECOND)
        run.summary["released_1"] = controller.release_partition(_SECOND)
        run.check([], f"release of {_SECOND}")
    summary = run.summary
    totals = controller.stats()["totals"]
    summary.update(segments_consumed=len(_segments_of(kept0)) + len(_segments_of(kept1)),
                   segments_dropped=len(_segments_of(dropped0)) + len(_segments_of(dropped1)),
                   sessions_carried=len(carried), keys_left=int(totals["keys"]), bytes_left=int(totals["used"]))
    summary["verified"] = (not summary["mismatched"] and all(c["ok"] for c in summary["invariants"])
                           and summary["keys_left"] == 0 and summary["bytes_left"] == 0)
    return summary


_FIRST, _SECOND = "overlap-0", "overlap-1"


def _segments_of(group) -> list:
    return [seg for session in group for seg in lineage_segments(session)]


@dataclass
class _Overlap:
    """One run of :func:`overlapping_rollouts`: what its steps share, and the summary they fill in."""

    controller: Any
    clients: Any
    writer: Writer
    reader: Reader
    fields: FieldRegistry
    synth: dict
    summary: dict

    def rollout(self, partition: str, sessions: int, seed: int) -> list:
        """Write ``sessions`` synthetic sessions into ``partition``: their families (a session and its branches)."""
        return _families(build_sessions(SyntheticConfig(sessions=sessions, seed=seed, **self.synth),
                                         fields=self.fields, writer=self.writer, partition=partition))

    def first(self, sessions: int, seed: int) -> tuple[list, list, list]:
        """Rollout 0, its first family carried to rollout 1 and its second dropped: (carried, dropped, kept)."""
        self.controller.open_partition(_FIRST)
        first = self.rollout(_FIRST, sessions, seed)
        self.writer.flush()
        carried, dropped, kept = first[0], first[1], [s for g in first[2:] for s in g]
        self.controller.open_partition(_SECOND)
        self.summary["keys_carried"] = carry(carried, _FIRST, _SECOND, self.clients)
        self.finish(kept, dropped, _FIRST)
        return carried, dropped, kept

    def finish(self, kept: list, dropped: list, partition: str) -> None:
        """The rollout's segments finalized, the ``dropped`` group's dropped."""
        self.writer.finalize([seg.layouts for seg in _segments_of(kept) + _segments_of(dropped)], partition)
        self.summary["keys_freed_by_drop"] += drop([seg.layouts for seg in _segments_of(dropped)], partition,
                                                   self.clients)

    def consume(self, kept: list, partition: str) -> None:
        """Train on the ``kept`` sessions' segments (checked bit-exact)."""
        self.summary["mismatched"] += _consume(self.reader, _segments_of(kept), partition)

    def check(self, referenced: list, when: str) -> None:
        report = self.controller.check_invariants(referenced)
        self.summary["invariants"].append({"after": when, "ok": report["ok"], "violations": report["violations"][:5]})
