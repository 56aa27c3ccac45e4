"""SGLang ``/generate`` responses in, session steps (and stored fields) out.

A proxy between the agent and SGLang calls :meth:`RolloutIngest.add` with
each response exactly as it came off the wire:

- ``meta_info["output_token_logprobs"]``: ``(logprob, token_id, text)``
  triples, one per generated token;
- ``meta_info["routed_experts"]`` (R3 on): base64 of int32 ``[rows, L, K]``
  covering context positions ``[start_len, seqlen - 1)``, where
  ``start_len`` is the ``routed_experts_start_len`` the caller sent (SGLang
  does not echo it back, so the caller passes it again here). Some builds
  return ``seqlen - start_len`` rows, the last for the final token that was
  never fed back; that row is dropped.
- ``output_ids`` (optional: the triples carry the same ids).

Rows that earlier steps of the same context already hold (a caller that
sent a ``start_len`` below where the session stands) are trimmed. When the
session keeps those earlier rows inline they are compared and a difference
is an error; when they were offloaded only, they are not compared: that
would read them back from the StorageUnits on every step. The rows stored
are always the first ones seen.

Everything is checked before any byte is stored (rows against tokens
against ``start_len``, L×K width, base64, ids of the triples against
``output_ids``, expert IDs against the stored dtype), and the fields are
stored inside the writer's commit region together with the step itself: a
step the session rejects leaves nothing stored. A response with no
generated token (an aborted request) adds no step and stores nothing; it
is counted in :attr:`RolloutIngest.aborted`, and the session's context is
unchanged, so the caller retries with the same ``start_len``.

Fields not offloaded (offload off, or not in ``transfer_params``) stay
inline on the step, so the samples built from it carry the arrays and the
trainer gets the same tensors either way. Routed experts are kept only with
``use_rollout_routing_replay`` (R3) on: without it the trainer does not
replay them, so a response that carries them anyway costs nothing.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from gputq.config import GputqConfig
from gputq.data.fields import LOGPROBS, ROUTED_EXPERTS
from gputq.data.keys import step_key
from gputq.data.trajectory import Session, StepRecord
from gputq.errors import ConfigError, FieldValueError, InvalidInputError

__all__ = ["EngineOutput", "RolloutIngest", "decode_response", "encode_response"]


@dataclass(frozen=True)
class EngineOutput:
    """One decoded response: generated ids, their logprobs and the routed experts as sent."""

    output_ids: np.ndarray          # int32 [n]
    logprobs: np.ndarray            # float32 [n]
    routed_experts: np.ndarray | None  # int32 [rows, L, K], rows as the engine sent them


def _decode_experts(data: Any, num_layers: int, topk: int, where: str) -> np.ndarray:
    if isinstance(data, np.ndarray):  # an in-process engine may hand the array itself
        # A cast would truncate float IDs and wrap wide ones: only IDs int32 holds are taken.
        int32 = np.iinfo(np.int32)
        if data.dtype.kind not in "iu":
            raise InvalidInputError(f"{where}: meta_info['routed_experts'] must hold integer expert IDs, "
                                    f"got {data.dtype}")
        if data.size and (int(data.min()) < int32.min or int(data.max()) > int32.max):
            raise FieldValueError(f"{where}: routed_experts holds IDs int32 cannot (range "
                                  f"{int(data.min())}..{int(data.max())})")
        raw = np.ascontiguousarray(data, dtype=np.int32).reshape(-1)
    else:
        if not isinstance(data, (str, bytes)):
            raise InvalidInputError(f"{where}: meta_info['routed_experts'] must be a base64 string, "
                                    f"got {type(data).__name__}")
        try:
            blob = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInputError(f"{where}: meta_info['routed_experts'] is not valid base64 ({exc})") from None
        if len(blob) % 4:
            raise InvalidInputError(f"{where}: routed_experts holds {len(blob)} bytes, not whole int32 values")
        raw = np.frombuffer(blob, dtype="<i4")
    width = num_layers * topk
    if raw.size % width:
        raise InvalidInputError(f"{where}: routed_experts holds {raw.size} int32 values, not a multiple of "
                                f"L×K = {num_layers}×{topk} = {width}")
    return raw.reshape(-1, num_layers, topk)


def _decode_logprobs(triples: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    if triples is None:
        return np.empty(0, np.float32), np.empty(0, np.int32)
    logprobs, ids = [], []
    for i, item in enumerate(triples):
        try:
            logprob, token_id = item[0], item[1]
        except (TypeError, IndexError, KeyError):
            raise InvalidInputError(f"{where}: output_token_logprobs[{i}] is not a (logprob, token_id, text) "
                                    f"triple: {item!r}") from None
        if logprob is None or isinstance(logprob, bool) or not isinstance(logprob, (int, float, np.number)):
            raise FieldValueError(f"{where}: output_token_logprobs[{i}] has logprob {logprob!r}")
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
            raise InvalidInputError(f"{where}: output_token_logprobs[{i}] has token id {token_id!r}")
        logprobs.append(logprob)
        ids.append(token_id)
    return np.asarray(logprobs, dtype=np.float32), np.asarray(ids, dtype=np.int64)


def decode_response(response: Mapping[str, Any], num_layers: int, topk: int, *,
                    where: str = "response") -> EngineOutput:
    """Decode one ``/generate`` response (checks shapes and ids, not rows against the prompt)."""
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        raise InvalidInputError(f"{where}: no meta_info mapping in the response (keys {sorted(response)})")
    logprobs, triple_ids = _decode_logprobs(meta.get("output_token_logprobs"), where)
    ids = response.get("output_ids")
    if ids is None:
        ids = triple_ids
    try:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise InvalidInputError(f"{where}: output_ids is not a sequence of token ids") from None
    if len(ids) != len(logprobs) or not np.array_equal(ids, triple_ids):
        raise InvalidInputError(f"{where}: {len(ids)} output_ids but {len(logprobs)} output_token_logprobs "
                                f"triples (or their token ids differ)")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise InvalidInputError(f"{where}: output ids outside [0, 2**31)")
    experts = meta.get(ROUTED_EXPERTS)
    experts = None if experts is None else _decode_experts(experts, num_layers, topk, where)
    return EngineOutput(ids.astype(np.int32), logprobs, experts)


def encode_response(output_ids: Sequence[int], logprobs: Sequence[float],
                    routed_experts: np.ndarray | None = None) -> dict[str, Any]:
    """A ``/generate`` response in SGLang's wire format (for fakes, tests and the demo)."""
    meta: dict[str, Any] = {
        "output_token_logprobs": [(float(lp), int(t), None) for lp, t in zip(logprobs, output_ids)],
        "completion_tokens": len(output_ids),
    }
    if routed_experts is not None:
        meta[ROUTED_EXPERTS] = base64.b64encode(
            np.ascontiguousarray(routed_experts, dtype="<i4").tobytes()).decode("ascii")
    return {"text": "", "output_ids": [int(t) for t in output_ids], "meta_info": meta}


class RolloutIngest:
    """Turns SGLang responses into session steps, storing the offloaded fields.

    Parameters
    ----------
    config:
        The deployment's config (the writer's): which fields are offloaded
        and the stored expert dtype. The field specs come from it.
    num_layers, topk:
        Recorded MoE layers and routing top-k (the engine's L and K).
    partition:
        Rollout the stored steps belong to.
    writer:
        Stores the offloaded fields; required when any field is offloaded.
    keep_inline:
        Keep every field's arrays on the steps even when offloaded (a
        reference path for checks, and what lets overlapping rows be compared).
    """

    def __init__(self, config: GputqConfig, *, num_layers: int, topk: int, partition: str,
                 writer=None, keep_inline: bool = False):
        self.config = config
        self.fields = config.field_registry(num_layers, topk)
        self.partition = partition
        self.offloaded = config.offloaded_fields
        if self.offloaded and writer is None:
            raise ConfigError(f"fields {list(self.offloaded)} are offloaded: RolloutIngest needs a writer")
        self._writer = writer
        self._keep_inline = keep_inline
        self._layers, self._topk = num_layers, topk
        self.aborted = 0

    def session(self, session_id: str, prompt_ids: Any = None) -> Session:
        """A new session with this ingest's field specs."""
        return Session.create(session_id, self.fields, prompt_ids)

    def add(self, session: Session, prompt_ids: Any, response: Mapping[str, Any], *,
            start_len: int = 0) -> StepRecord | None:
        """Record one model call of ``session`` from its raw response.

        Parameters
        ----------
        prompt_ids:
            The full prompt sent (it must extend ``session.context``).
        response:
            The ``/generate`` response as received (JSON-decoded).
        start_len:
            The ``routed_experts_start_len`` sent with the request.

        Returns
        -------
        The new step, or ``None`` for a response with no generated token.
        """
        index = len(session.steps)
        where = f"session {session.session_id!r} step {index}"
        out = decode_response(response, self._layers, self._topk, where=where)
        if len(out.output_ids) == 0:
            self.aborted += 1
            return None
        prompt = np.asarray(prompt_ids).reshape(-1)
        arrays = {LOGPROBS: out.logprobs}
        if out.routed_experts is not None and self.config.use_rollout_routing_replay:
            arrays[ROUTED_EXPERTS] = self._new_rows(session, where, len(prompt), len(out.output_ids),
                                                    out.routed_experts, start_len)
        elif self.config.use_rollout_routing_replay:
            raise InvalidInputError(f"{where}: R3 is on but the response has no meta_info['routed_experts'] "
                                    f"(was the request sent with return_routed_experts?)")
        offload = {name: a for name, a in arrays.items() if name in self.offloaded}
        inline = arrays if self._keep_inline else {n: a for n, a in arrays.items() if n not in offload}
        if not offload:
            return session.append_step(prompt, out.output_ids, arrays=inline)
        with self._writer.commit_region() as region:
            refs = region.put(step_key(self.partition, session.session_id, index), self.partition, offload)
            return session.append_step(prompt, out.output_ids, arrays=inline, refs=refs)

    def _new_rows(self, session: Session, where: str, prompt_len: int, n_out: int,
                  experts: np.ndarray, start_len: int) -> np.ndarray:
        """The rows of ``experts`` this step adds: [session.next_start, seqlen - 1)."""
        seqlen = prompt_len + n_out
        rows = len(experts)
        if isinstance(start_len, bool) or not isinstance(start_len, (int, np.integer)) \
                or not 0 <= start_len < seqlen:
            raise InvalidInputError(f"{where}: start_len {start_len!r} outside [0, seqlen={seqlen})")
        if rows == seqlen - start_len:  # the variant with a row for the last token
            experts = experts[:-1]
        elif rows != seqlen - 1 - start_len:
            raise InvalidInputError(
                f"{where}: routed_experts has {rows} rows, but start_len {start_len} and seqlen {seqlen} "
                f"(prompt {prompt_len} + output {n_out} tokens) give {seqlen - 1 - start_len} "
                f"(or {seqlen - start_len} with the last token's row)")
        need = session.next_start
        if start_len > need:
            raise InvalidInputError(
                f"{where}: start_len {start_len} is past this context's next position {need}: rows "
                f"[{need}, {start_len}) were never returned")
        if start_len < need:
            self._check_overlap(session, where, experts[:need - start_len], start_len)
            experts = experts[need - start_len:]
        return experts

    def _check_overlap(self, session: Session, where: str, rows: np.ndarray, start: int) -> None:
        """Compare re-sent rows with the ones earlier steps keep inline (when they all do)."""
        held = []
        step = session.steps[-1] if session.steps else None
        while step is not None and step.seqlen - 1 > start:
            kept = step.arrays.get(ROUTED_EXPERTS)
            if kept is None:
                return  # offloaded only: see the module docstring
            held.append((step.start, kept))
            step = step.parent
        for first, kept in held:
            lo = max(first, start)
            got, want = rows[lo - start:lo - start + len(kept) - (lo - first)], kept[lo - first:]
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero((got != want).reshape(len(got), -1).any(axis=1))[0])
                raise FieldValueError(f"{where}: routed_experts re-sent for position {lo + bad} differ "
                                      f"from the rows an earlier step stored")
