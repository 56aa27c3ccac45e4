"""The rollout-side model: sessions of steps, and the segments built from them.

Conventions (slime / SGLang). A model call (a *step*) sees a context of
``prompt_len`` tokens and generates ``n_out`` tokens, so
``seqlen = prompt_len + n_out``. The engine returns:

- ``routed_experts`` for token positions ``[start, seqlen - 1)``, int32
  ``[seqlen - 1 - start, L, K]``, where ``start`` is where the previous step
  of the same context stopped (its ``seqlen - 1``), or 0 for the first step
  of a context;
- ``logprobs`` float32 ``[n_out]`` for the generated tokens.

A trainer sample has ``T`` tokens (its whole context) and a response (what
follows the sample's initial prompt). slime wants ``rollout_log_probs``
float32 ``[response_len]`` (tool/observation tokens inside the response get
the fill 0.0) and ``rollout_routed_experts`` int32 ``[T-1, L, K]``.

A step keeps its fields as :class:`~gputq.data.refs.FieldRef` (offload path), as
arrays (inline path) or both. Segments compose :class:`~gputq.data.refs.Layout`
objects from refs only, never reading payloads back.
:func:`inline_fields` rebuilds the trainer fields straight from the inline
arrays with plain concatenation, independently of the layout algebra, so a
test comparing it with :func:`materialize_layouts` checks that algebra.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import numpy as np

from gputq.data.fields import FieldRegistry, FieldSpec
from gputq.data.packing import unpack_rows
from gputq.data.refs import FieldRef, Layout, read_record
from gputq.errors import FieldValueError, InvalidInputError, LayoutError

__all__ = [
    "Segment",
    "Session",
    "StepRecord",
    "inline_fields",
    "lineage_segments",
    "materialize_layouts",
    "timeline_segments",
]

_SAMPLE_SCHEMA = 1
_EMPTY_TOKENS = np.empty(0, dtype=np.int32)
_INT32_MAX = np.iinfo(np.int32).max


def _as_tokens(what: str, ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.size == 0:
        return _EMPTY_TOKENS
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidInputError(f"{what} must be a 1-D integer sequence, got shape {arr.shape} dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > _INT32_MAX:
        raise InvalidInputError(f"{what} holds token ids outside [0, {_INT32_MAX}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class StepRecord:
    """One model call of a session.

    Attributes
    ----------
    index:
        Position in its session (shared by branches that include it).
    prompt_len, start:
        Context length seen by the call, and the first context position its
        context-span fields cover.
    added_ids:
        Tokens this call added to the context: the whole prompt for the first
        step of a context, the tool/observation tokens otherwise.
    output_ids:
        Generated tokens.
    parent:
        The previous step of the same context, or None.
    refs, arrays:
        The step's fields by name, as stored references and/or inline arrays.
    """

    index: int
    prompt_len: int
    start: int
    added_ids: np.ndarray
    output_ids: np.ndarray
    parent: StepRecord | None
    refs: Mapping[str, FieldRef]
    arrays: Mapping[str, np.ndarray]

    @property
    def n_out(self) -> int:
        """Generated tokens."""
        return len(self.output_ids)

    @property
    def seqlen(self) -> int:
        """Context length after the call."""
        return self.prompt_len + self.n_out

    def field_rows(self, spec: FieldSpec) -> int:
        """Rows this step produces for ``spec``."""
        return self.n_out if spec.span == "output" else self.seqlen - 1 - self.start

    def context_tokens(self) -> np.ndarray:
        """The whole context after this call (prompt + output), int32."""
        parts = []
        step: StepRecord | None = self
        while step is not None:
            parts += [step.output_ids, step.added_ids]
            step = step.parent
        return np.concatenate(parts[::-1])


class Session:
    """One rollout interaction: a linear list of steps, possibly sharing a prefix.

    Use :meth:`create`, then :meth:`append_step` per model call,
    :meth:`rewrite_context` when the next call starts a fresh context, and
    :meth:`branch` to fork at an earlier step (the branch shares the prefix
    steps and their refs).
    """

    def __init__(self, session_id: str, fields: FieldRegistry, steps: list[StepRecord],
                 context: np.ndarray, last: StepRecord | None):
        self.session_id = session_id
        self.fields = fields
        self._steps = steps
        self._context = context
        self._last = last
        self._branches = 0

    @classmethod
    def create(cls, session_id: str, fields: FieldRegistry, prompt_ids: Any = None) -> Session:
        """A new session; ``prompt_ids`` (optional) is what the first prompt must start with."""
        return cls(session_id, fields, [], _as_tokens("prompt_ids", () if prompt_ids is None else prompt_ids),
                   None)

    @property
    def steps(self) -> tuple[StepRecord, ...]:
        """The steps of this session, shared prefix included."""
        return tuple(self._steps)

    @property
    def context(self) -> np.ndarray:
        """Tokens the next prompt must start with."""
        return self._context

    @property
    def next_start(self) -> int:
        """First context position the next step's context-span fields cover."""
        return self._last.seqlen - 1 if self._last is not None else 0

    def append_step(self, prompt_ids: Any, output_ids: Any, *,
                    arrays: Mapping[str, np.ndarray] | None = None,
                    refs: Mapping[str, FieldRef] | None = None) -> StepRecord:
        """Record one model call.

        Parameters
        ----------
        prompt_ids:
            The full prompt sent to the engine; it must extend :attr:`context`
            (call :meth:`rewrite_context` first to start a new context).
        output_ids:
            Generated tokens (at least one).
        arrays, refs:
            The step's fields (inline arrays as the engine returned them,
            and/or refs from a writer), checked against the expected rows.
        """
        prompt = _as_tokens("prompt_ids", prompt_ids)
        output = _as_tokens("output_ids", output_ids)
        where = f"session {self.session_id!r} step {len(self._steps)}"
        ctx = self._context
        if len(prompt) == 0 or output.size == 0:
            raise InvalidInputError(f"{where}: prompt and output must each hold at least one token")
        if len(prompt) < len(ctx) or not np.array_equal(prompt[:len(ctx)], ctx):
            raise InvalidInputError(f"{where}: prompt does not extend the current context of {len(ctx)} tokens; "
                                    f"call rewrite_context() to start a new context")
        parent = self._last
        start = parent.seqlen - 1 if parent is not None else 0
        added = prompt[len(ctx):] if parent is not None else prompt
        record = StepRecord(len(self._steps), len(prompt), start, added, output, parent, {}, {})
        record = replace(record, arrays=self._check_arrays(where, record, arrays or {}),
                         refs=self._check_refs(where, record, refs or {}))
        self._steps.append(record)
        self._context = np.concatenate([prompt, output])
        self._last = record
        return record

    def _check_arrays(self, where: str, step: StepRecord, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        checked = {}
        for name, value in arrays.items():
            spec = self.fields.get(name)
            arr = np.asarray(value)
            expected = (step.field_rows(spec), *spec.row_shape)
            if arr.shape != expected:
                raise FieldValueError(f"{where} field {name!r}: expected shape {expected}, got {arr.shape}")
            checked[name] = arr
        return checked

    def _check_refs(self, where: str, step: StepRecord, refs: Mapping[str, FieldRef]) -> dict[str, FieldRef]:
        for name, ref in refs.items():
            spec = self.fields.get(name)
            if not isinstance(ref, FieldRef) or ref.field != name:
                raise InvalidInputError(f"{where}: refs[{name!r}] must be a FieldRef of field {name!r}, got {ref!r}")
            expected = (step.field_rows(spec), spec.row_shape, spec.dtype, spec.num_experts)
            if (ref.rows, ref.row_shape, ref.dtype, ref.num_experts) != expected:
                raise InvalidInputError(f"{where} field {name!r}: ref {ref.key!r} has rows/row_shape/dtype/num_experts "
                                        f"{(ref.rows, ref.row_shape, ref.dtype, ref.num_experts)}, expected {expected}")
        return dict(refs)

    def rewrite_context(self, new_prompt_ids: Any) -> None:
        """Start a new context: the next step's prompt must start with ``new_prompt_ids``.

        The next step covers its context from position 0 again.
        """
        self._context = _as_tokens("new_prompt_ids", new_prompt_ids)
        self._last = None

    def branch(self, from_step: int, session_id: str | None = None) -> Session:
        """A new session sharing steps ``0..from_step`` and continuing after ``from_step``."""
        if not 0 <= from_step < len(self._steps):
            raise InvalidInputError(f"session {self.session_id!r} has {len(self._steps)} steps; "
                                    f"cannot branch from step {from_step}")
        if session_id is None:
            self._branches += 1
            session_id = f"{self.session_id}.b{self._branches}"
        step = self._steps[from_step]
        return Session(session_id, self.fields, self._steps[:from_step + 1], step.context_tokens(), step)


@dataclass(frozen=True, eq=False)
class Segment:
    """A trainable sample: tokens plus one :class:`Layout` per offloaded field.

    Attributes
    ----------
    segment_id:
        ``"<session>/t<step>"`` (timeline) or ``"<session>/l<first step>"`` (lineage).
    tokens:
        The sample's whole context, int32 ``[T]``.
    prompt_len:
        Tokens before the response.
    fields:
        Specs of the fields the sample carries.
    layouts:
        Layouts of the fields every contributing step has refs for.
    steps:
        The steps the segment was built from (local only; not in :meth:`to_sample`).
    """

    segment_id: str
    tokens: np.ndarray
    prompt_len: int
    fields: Mapping[str, FieldSpec]
    layouts: Mapping[str, Layout]
    steps: tuple[StepRecord, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.prompt_len <= len(self.tokens):
            raise LayoutError(f"segment {self.segment_id!r}: prompt_len {self.prompt_len} "
                              f"outside (0, {len(self.tokens)}]")
        for name, layout in self.layouts.items():
            spec = self.fields.get(name)
            rows = self.response_len if spec is not None and spec.span == "output" else len(self.tokens) - 1
            if spec is None or layout.field != name or layout.rows != rows:
                raise LayoutError(f"segment {self.segment_id!r}: layout {layout.describe()} does not fit "
                                  f"field {name!r} with {rows} rows")

    @property
    def response_len(self) -> int:
        """Tokens after the prompt."""
        return len(self.tokens) - self.prompt_len

    def to_sample(self) -> dict[str, Any]:
        """A lightweight dict for Ray: tokens, lengths, field specs and layouts (no payload)."""
        return {"schema": _SAMPLE_SCHEMA, "segment_id": self.segment_id, "tokens": self.tokens,
                "prompt_len": self.prompt_len, "response_len": self.response_len,
                "fields": {n: spec.to_dict() for n, spec in self.fields.items()},
                "layouts": {n: layout.to_dict() for n, layout in self.layouts.items()}}

    @classmethod
    def from_sample(cls, sample: Mapping[str, Any]) -> Segment:
        """Inverse of :meth:`to_sample` (without local steps)."""
        rec = read_record(sample, "Segment", _SAMPLE_SCHEMA,
                          ("segment_id", "tokens", "prompt_len", "response_len", "fields", "layouts"))
        tokens = _as_tokens("tokens", rec["tokens"])
        if rec["response_len"] != len(tokens) - rec["prompt_len"]:
            raise InvalidInputError(f"sample {rec['segment_id']!r}: response_len {rec['response_len']} != "
                                    f"{len(tokens)} tokens - prompt_len {rec['prompt_len']}")
        return cls(rec["segment_id"], tokens, rec["prompt_len"],
                   {n: FieldSpec.from_dict(d) for n, d in rec["fields"].items()},
                   {n: Layout.from_dict(d) for n, d in rec["layouts"].items()})


def _contributing(spec: FieldSpec, steps: tuple[StepRecord, ...], prompt_len: int) -> tuple[StepRecord, ...]:
    """Steps whose rows of ``spec`` land in a sample with this prompt length."""
    if spec.span == "context":
        return steps
    return tuple(s for s in steps if s.prompt_len >= prompt_len)


def _present(where: str, name: str, steps: tuple[StepRecord, ...], attr: str) -> bool:
    have = [name in getattr(s, attr) for s in steps]
    if any(have) and not all(have):
        missing = [s.index for s, h in zip(steps, have) if not h]
        raise InvalidInputError(f"{where}: field {name!r} has {attr} in some steps but not in steps {missing}")
    return all(have)


def _layout_of(spec: FieldSpec, steps: tuple[StepRecord, ...], prompt_len: int) -> Layout:
    def whole(step: StepRecord) -> Layout:
        return Layout.from_ref(step.refs[spec.name], fill=spec.fill, dtype=spec.restored_dtype)

    if spec.span == "context":
        return Layout.concat(whole(s) for s in steps)
    parts, cursor = [], prompt_len
    for step in steps:
        if step.prompt_len > cursor:
            parts.append(Layout.empty(spec.name, step.prompt_len - cursor, fill=spec.fill,
                                      dtype=spec.restored_dtype, row_shape=spec.row_shape))
        parts.append(whole(step))
        cursor = step.seqlen
    return Layout.concat(parts)


def _build_segment(segment_id: str, tokens: np.ndarray, prompt_len: int, chain: tuple[StepRecord, ...],
                   fields: FieldRegistry) -> Segment:
    layouts = {}
    for spec in fields:
        steps = _contributing(spec, chain, prompt_len)
        if _present(f"segment {segment_id!r}", spec.name, steps, "refs"):
            layouts[spec.name] = _layout_of(spec, steps, prompt_len)
    return Segment(segment_id, tokens, prompt_len, {spec.name: spec for spec in fields}, layouts, chain)


def timeline_segments(session: Session) -> list[Segment]:
    """One segment per step: its context is the sample, its output the response.

    Context-span fields compose every step of the same context up to it;
    output-span fields hold that step's generated tokens only.
    """
    segments, chain, tokens = [], (), _EMPTY_TOKENS
    for step in session.steps:
        if step.parent is None:
            chain, tokens = (step,), np.concatenate([step.added_ids, step.output_ids])
        else:
            chain, tokens = chain + (step,), np.concatenate([tokens, step.added_ids, step.output_ids])
        segments.append(_build_segment(f"{session.session_id}/t{step.index}", tokens, step.prompt_len,
                                       chain, session.fields))
    return segments


def lineage_segments(session: Session) -> list[Segment]:
    """One segment per context of the session (cut where it was rewritten).

    The sample covers the whole context; its response is everything after the
    context's first prompt, with every generated token's output-span rows and
    fill for the tool tokens in between.
    """
    groups: list[list[StepRecord]] = []
    for step in session.steps:
        if step.parent is None:
            groups.append([])
        groups[-1].append(step)
    return [_build_segment(f"{session.session_id}/l{group[0].index}", group[-1].context_tokens(),
                           group[0].prompt_len, tuple(group), session.fields)
            for group in groups]


def inline_fields(segment: Segment) -> dict[str, np.ndarray]:
    """The trainer fields of ``segment`` from its steps' inline arrays (the non-offloaded path).

    Returns slime's names (``rollout_log_probs``, ``rollout_routed_experts``)
    mapped to arrays of the restored dtypes, for every field all
    contributing steps hold arrays for.
    """
    if not segment.steps:
        raise InvalidInputError(f"segment {segment.segment_id!r} has no local steps (rebuilt from a sample?)")
    out = {}
    for spec in segment.fields.values():
        steps = _contributing(spec, segment.steps, segment.prompt_len)
        if not _present(f"segment {segment.segment_id!r}", spec.name, steps, "arrays"):
            continue
        if spec.span == "context":
            parts = [s.arrays[spec.name] for s in steps]
        else:
            parts, cursor = [], segment.prompt_len
            for s in steps:
                parts += [np.full((s.prompt_len - cursor, *spec.row_shape), spec.fill, spec.restored_dtype),
                          s.arrays[spec.name]]
                cursor = s.seqlen
        out[spec.sample_key] = np.concatenate(parts).astype(spec.restored_dtype, copy=False)
    return out


def materialize_layouts(segment: Segment, lookup: Callable[[FieldRef], np.ndarray]) -> dict[str, np.ndarray]:
    """Restore every layout of ``segment`` with numpy.

    ``lookup(ref)`` returns the stored array of ``ref`` (stored dtype,
    ``[ref.rows, *ref.stored_shape]``, token-major; packed IDs are unpacked here). Returns the same mapping as
    :func:`inline_fields`. The trainer's reader does this with the kernel;
    this is the reference for tests and tools.
    """
    out = {}
    for name, layout in segment.layouts.items():
        target = np.full((layout.rows, *layout.row_shape), layout.fill, dtype=layout.dtype)
        for frag in layout.fragments:
            data, ref = lookup(frag.ref), frag.ref
            if data.shape != (ref.rows, *ref.stored_shape) or data.dtype != np.dtype(ref.dtype):
                raise InvalidInputError(f"lookup({ref.key!r}) returned {data.dtype}{data.shape}, expected "
                                        f"{ref.dtype}{(ref.rows, *ref.stored_shape)}")
            rows = data[frag.src_row:frag.src_row + frag.rows]
            if ref.num_experts:
                rows = unpack_rows(rows, ref.row_shape[-1], ref.num_experts)
            target[frag.dst_row:frag.dst_end] = rows
        out[segment.fields[name].sample_key] = target
    return out
