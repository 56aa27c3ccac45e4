"""Seeded synthetic rollouts shaped like SGLang responses.

:func:`generate_calls` yields one :class:`SyntheticCall` per model call: the
prompt sent, the SGLang-shaped engine output, and what happened to the
session before the call (a branch, a context rewrite). Lengths are ragged,
everything is deterministic in ``seed``, and each session draws from its own
stream, so session ``i`` is the same whatever ``sessions`` is.

:func:`build_sessions` replays the calls onto :class:`~gputq.data.trajectory.Session`
objects, keeping inline arrays (the reference path) and/or handing each
step's fields to a writer (the offload path) under the deterministic key
``f"{partition}/{session_id}/{step_index}"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

import numpy as np

from gputq.data.fields import LOGPROBS, ROUTED_EXPERTS, FieldRegistry
from gputq.data.keys import step_key
from gputq.data.refs import FieldRef
from gputq.data.trajectory import Session
from gputq.errors import ConfigError
from gputq.integrations.sglang import RolloutIngest, encode_response

__all__ = ["FieldWriter", "SyntheticCall", "SyntheticConfig", "build_sessions", "engine_fields",
           "generate_calls", "ingest_synthetic"]


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of a synthetic rollout.

    Token counts are means: each draw is uniform in ``[n/2, 3n/2]``.
    ``steps_per_session`` counts the main branch; every branch (drawn with
    ``branch_prob`` after each main step, forking at a random earlier step)
    adds one or two steps of its own. ``rewrite_prob`` is the chance that a
    main-branch step after the first starts a fresh context.
    """

    sessions: int = 4
    steps_per_session: int = 4
    layers: int = 4
    topk: int = 2
    num_experts: int = 64
    prompt_tokens: int = 32
    tokens_per_step: int = 16
    tool_tokens: int = 8
    branch_prob: float = 0.0
    rewrite_prob: float = 0.0
    seed: int = 0
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        for name in ("sessions", "steps_per_session", "layers", "topk", "num_experts", "prompt_tokens",
                     "tokens_per_step", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"SyntheticConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_tokens < 0:
            raise ConfigError(f"SyntheticConfig.tool_tokens must be >= 0, got {self.tool_tokens}")
        for name in ("branch_prob", "rewrite_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"SyntheticConfig.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class SyntheticCall:
    """One synthetic model call.

    Attributes
    ----------
    session_id:
        The (branch) session the call belongs to, e.g. ``"s0002"`` or ``"s0002.b1"``.
    step_index:
        Index of the step in that session (shared prefix included).
    branch_from:
        ``(parent session id, step index)`` on the first call of a branch, else None.
    rewrite:
        The new context's prompt when the context was rewritten before this call.
    prompt_ids:
        Full prompt sent to the engine (int32).
    engine_output:
        ``{"output_ids", "meta_info": {"output_token_logprobs", "routed_experts"}}``.
    """

    session_id: str
    step_index: int
    branch_from: tuple[str, int] | None
    rewrite: np.ndarray | None
    prompt_ids: np.ndarray
    engine_output: dict[str, Any]


@dataclass
class _Branch:
    context: np.ndarray      # tokens the next prompt extends
    start: int               # first context position the next call's routed experts cover
    history: list            # (context, start) after each step, for forking


def _ragged(rng: np.random.Generator, mean: int) -> int:
    return int(rng.integers(mean - mean // 2, mean + mean // 2 + 1)) if mean else 0


def _call(cfg: SyntheticConfig, rng: np.random.Generator, session_id: str, branch: _Branch,
          branch_from: tuple[str, int] | None, rewrite: np.ndarray | None) -> SyntheticCall:
    prompt = branch.context
    n_out = _ragged(rng, cfg.tokens_per_step)
    output = rng.integers(0, cfg.vocab_size, n_out, dtype=np.int32)
    seqlen = len(prompt) + n_out
    experts = rng.integers(0, cfg.num_experts, (seqlen - 1 - branch.start, cfg.layers, cfg.topk), dtype=np.int32)
    logprobs = -rng.exponential(1.0, n_out).astype(np.float32)
    call = SyntheticCall(session_id, len(branch.history), branch_from, rewrite, prompt,
                         {"output_ids": output,
                          "meta_info": {"output_token_logprobs": logprobs, "routed_experts": experts}})
    branch.context = np.concatenate([prompt, output])
    branch.start = seqlen - 1
    branch.history.append((branch.context, branch.start))
    return call


def _extend(cfg: SyntheticConfig, rng: np.random.Generator, branch: _Branch) -> None:
    tool = rng.integers(0, cfg.vocab_size, _ragged(rng, cfg.tool_tokens), dtype=np.int32)
    branch.context = np.concatenate([branch.context, tool])


def generate_calls(cfg: SyntheticConfig) -> Iterator[SyntheticCall]:
    """Yield every model call of every session, in an order that can be replayed."""
    for s in range(cfg.sessions):
        rng = np.random.default_rng([cfg.seed, s])
        root_id = f"s{s:04d}"
        main = _Branch(rng.integers(0, cfg.vocab_size, _ragged(rng, cfg.prompt_tokens), dtype=np.int32), 0, [])
        forks = 0
        for j in range(cfg.steps_per_session):
            rewrite = None
            if j and rng.random() < cfg.rewrite_prob:
                rewrite = rng.integers(0, cfg.vocab_size, _ragged(rng, cfg.prompt_tokens), dtype=np.int32)
                main.context, main.start = rewrite, 0
            elif j:
                _extend(cfg, rng, main)
            yield _call(cfg, rng, root_id, main, None, rewrite)
            if rng.random() < cfg.branch_prob:
                forks += 1
                at = int(rng.integers(0, j + 1))
                context, start = main.history[at]
                fork = _Branch(context, start, main.history[:at + 1])
                for k in range(int(rng.integers(1, 3))):
                    _extend(cfg, rng, fork)
                    yield _call(cfg, rng, f"{root_id}.b{forks}", fork, (root_id, at) if k == 0 else None, None)


def engine_fields(engine_output: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The gputq fields of an SGLang-shaped engine output."""
    meta = engine_output["meta_info"]
    return {LOGPROBS: np.asarray(meta["output_token_logprobs"], dtype=np.float32),
            ROUTED_EXPERTS: np.asarray(meta["routed_experts"])}


class FieldWriter(Protocol):
    """What :func:`build_sessions` needs from a writer (``gputq.client.writer.Writer`` fits)."""

    def put(self, key: str, partition: str, fields: Mapping[str, np.ndarray]) -> dict[str, FieldRef]:
        ...


def build_sessions(cfg: SyntheticConfig, *, fields: FieldRegistry | None = None,
                   writer: FieldWriter | None = None, partition: str = "rollout-0",
                   inline: bool = True) -> list[Session]:
    """Replay :func:`generate_calls` onto sessions.

    Parameters
    ----------
    cfg:
        The rollout to generate.
    fields:
        Field specs; defaults to the built-ins with int32 expert IDs. Their
        stored dtypes must match what ``writer`` stores.
    writer:
        When given, each step's engine fields (as returned by the engine;
        the writer canonicalises them) are put under :func:`step_key` and the
        returned refs recorded on the step.
    inline:
        Keep the engine arrays on the steps (the non-offloaded reference).

    Returns
    -------
    Every session, branches included, in creation order.
    """
    fields = fields if fields is not None else FieldRegistry.builtin(cfg.layers, cfg.topk)
    sessions: dict[str, Session] = {}
    for call in generate_calls(cfg):
        session = _session_of(call, sessions, lambda session_id: Session.create(session_id, fields))
        arrays = engine_fields(call.engine_output)
        refs = None
        if writer is not None:
            refs = writer.put(step_key(partition, call.session_id, call.step_index), partition, arrays)
        session.append_step(call.prompt_ids, call.engine_output["output_ids"],
                            arrays=arrays if inline else None, refs=refs)
    return list(sessions.values())


def _session_of(call, sessions: dict, create) -> Session:
    """The session ``call`` extends, as the engine saw it: branched off its parent where it branches, made by
    ``create(session_id)`` where it is new, its context rewritten where the call rewrites it."""
    if call.branch_from is not None:
        parent_id, at = call.branch_from
        sessions[call.session_id] = sessions[parent_id].branch(at, session_id=call.session_id)
    session = sessions.get(call.session_id)
    if session is None:
        session = sessions[call.session_id] = create(call.session_id)
    if call.rewrite is not None:
        session.rewrite_context(call.rewrite)
    return session


def ingest_synthetic(synth: SyntheticConfig, ingest: RolloutIngest) -> list[Session]:
    """Replay a synthetic rollout through the wire format and :meth:`RolloutIngest.add`.

    Each call's engine output is encoded as SGLang sends it (base64 experts,
    logprob triples) and decoded again by the ingest path, exactly as a
    proxy would see it. Returns every session, branches included.
    """
    sessions: dict[str, Session] = {}
    for call in generate_calls(synth):
        session = _session_of(call, sessions, ingest.session)
        meta = call.engine_output["meta_info"]
        output = call.engine_output["output_ids"]
        experts = meta["routed_experts"]
        # The start the proxy sent: where this context's rows begin.
        start_len = len(call.prompt_ids) + len(output) - 1 - len(experts)
        ingest.add(session, call.prompt_ids, encode_response(output, meta["output_token_logprobs"], experts),
                   start_len=start_len)
    return list(sessions.values())
