"""slime-format samples: built from segments on the rollout side, hydrated on the trainer side.

A slime sample is a dict with ``tokens`` (the whole context),
``response_length``, ``loss_mask`` (1 for generated tokens of the response,
0 for tool/observation tokens) and the two R3 fields under
:func:`~gputq.data.fields.sample_key_of` names: ``rollout_log_probs`` (float32,
response only) and ``rollout_routed_experts`` (int32 ``[len(tokens)-1, L, K]``).

:func:`to_slime_sample` puts a layout (a small dict, no payload) in the
offloaded fields and the arrays themselves in the fields kept inline. After
the data-parallel split each rank calls :func:`hydrate` on its samples: the
layouts are replaced in place by the restored tensors (numpy on CPU, torch
on CUDA), every sample is checked the way slime checks it, and the shard's
references are released. Inline fields are left untouched, so a run with
offload off, or with a field not offloaded, gives the trainer the same tensors.
That is for small jobs: at scale each rank calls :func:`stream` instead and
gets one micro-batch at a time of only its pipeline stage's layers and its
context-parallel tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Sequence

import numpy as np

from gputq.data.fields import LOGPROBS, ROUTED_EXPERTS, sample_key_of
from gputq.data.refs import Layout
from gputq.data.trajectory import Segment, inline_fields
from gputq.errors import InvalidInputError, LayoutError

__all__ = ["TOKENS", "RESPONSE_LENGTH", "LOSS_MASK", "LOG_PROBS", "ROUTED_EXPERTS_KEY", "SAMPLE_FIELDS",
           "to_slime_sample", "hydrate", "stream", "check_sample", "loss_mask"]

TOKENS = "tokens"
RESPONSE_LENGTH = "response_length"
LOSS_MASK = "loss_mask"
LOG_PROBS = sample_key_of(LOGPROBS)
ROUTED_EXPERTS_KEY = sample_key_of(ROUTED_EXPERTS)
#: Every sample field gputq reads or writes.
SAMPLE_FIELDS = (TOKENS, RESPONSE_LENGTH, LOSS_MASK, LOG_PROBS, ROUTED_EXPERTS_KEY)
_FIELD_OF_KEY = {sample_key_of(name): name for name in (LOGPROBS, ROUTED_EXPERTS)}


def loss_mask(segment: Segment) -> list[int]:
    """1 for the response tokens some step of ``segment`` generated, 0 for the rest."""
    if not segment.steps:
        raise InvalidInputError(f"segment {segment.segment_id!r} has no local steps (rebuilt from a sample?)")
    mask = np.zeros(segment.response_len, dtype=np.int32)
    for step in segment.steps:
        if step.prompt_len >= segment.prompt_len:  # steps before the sample's prompt are context
            mask[step.prompt_len - segment.prompt_len:step.seqlen - segment.prompt_len] = 1
    return mask.tolist()


def to_slime_sample(segment: Segment) -> dict[str, Any]:
    """The slime sample of ``segment``: layouts for offloaded fields, arrays for inline ones."""
    sample: dict[str, Any] = {TOKENS: segment.tokens.tolist(), RESPONSE_LENGTH: segment.response_len,
                              LOSS_MASK: loss_mask(segment)}
    inline = None
    for name, spec in segment.fields.items():
        if name in segment.layouts:
            sample[spec.sample_key] = segment.layouts[name].to_dict()
        else:
            inline = inline_fields(segment) if inline is None else inline
            if spec.sample_key in inline:
                sample[spec.sample_key] = inline[spec.sample_key]
    return sample


def _layouts_of(sample: Mapping[str, Any], index: int) -> dict[str, Layout]:
    layouts = {}
    for key, name in _FIELD_OF_KEY.items():
        value = sample.get(key)
        if isinstance(value, Mapping):
            layout = Layout.from_dict(value)
            if layout.field != name:
                raise LayoutError(f"sample {index}: {key} holds a layout of field {layout.field!r}")
            layouts[name] = layout
    return layouts


def hydrate(samples: Sequence[MutableMapping[str, Any]], reader, partition: str, *,
            release: bool = True) -> Sequence[MutableMapping[str, Any]]:
    """Restore the offloaded fields of one rank's ``samples`` in place.

    Parameters
    ----------
    samples:
        The rank's slime samples after the data-parallel split.
    reader:
        The rank's :class:`~gputq.client.reader.Reader` (its ``device`` decides
        numpy or CUDA torch tensors).
    partition:
        The rollout the samples came from.
    release:
        Release the shard's references once restored (they are consumed).

    Returns
    -------
    ``samples``, each passing :func:`check_sample`.
    """
    per_sample = [_layouts_of(sample, i) for i, sample in enumerate(samples)]
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, layouts in enumerate(per_sample):
        if layouts:
            groups.setdefault(tuple(sorted(layouts)), []).append(i)
    for indices in groups.values():  # a shard's samples normally share one field set: one fetch
        shard = [per_sample[i] for i in indices]
        for i, fields in zip(indices, reader.fetch(shard)):
            samples[i].update(fields)
    for sample in samples:
        check_sample(sample)
    if release:
        shard = [layouts for layouts in per_sample if layouts]
        if shard:
            reader.release(shard, partition)
    return samples


def stream(samples: Sequence[Mapping[str, Any]], reader, micro_batches: Sequence[Sequence[int]], rank, *,
           prefetch: int = 2, release: str | None = None, fields: Sequence[str] | None = None,
           hold: bool = False):
    """Stream one rank's offloaded samples micro-batch by micro-batch: only its slice, in slime's layout.

    The large-job path (:func:`hydrate` restores whole samples, for small
    ones). ``samples`` are the rank's slime samples after the data-parallel
    split, every one offloaded; ``micro_batches`` the trainer's split of
    them; ``rank`` the :class:`~gputq.data.slices.ParallelSlice` of this
    rank. R3 rows are checked against ``len(tokens) - 1`` before anything
    is read. With ``release`` (the partition), each micro-batch's
    references go once the rank moves past it; finalize the rollout with
    ``readers`` set to the ranks of a data-parallel group, each of which
    streams and releases.

    Returns
    -------
    MicroBatchStream
        See :meth:`Reader.stream <gputq.client.reader.Reader.stream>`; each
        micro-batch's ``routed_experts`` is the list
        ``RouterReplay.set_replay_data`` takes and ``log_probs`` the CP-cut
        ``rollout_log_probs``; its ``replay_handles()`` are the lazy
        handles slime's ``RoutingReplay.record`` takes.
    """
    shard = []
    for i, sample in enumerate(samples):
        layouts = _layouts_of(sample, i)
        if not layouts:
            raise InvalidInputError(f"sample {i} has no offloaded field to stream")
        log_probs = layouts.get(LOGPROBS)
        if log_probs is not None and log_probs.rows != sample.get(RESPONSE_LENGTH):
            raise InvalidInputError(f"sample {i}: {LOG_PROBS} has {log_probs.rows} rows, response_length is "
                                    f"{sample.get(RESPONSE_LENGTH)}")
        shard.append(layouts)
    return reader.stream(shard, micro_batches, rank, prefetch=prefetch, release=release, fields=fields,
                         hold=hold, total_lengths=[len(sample[TOKENS]) for sample in samples])


def _shape_dtype(value: Any) -> tuple[tuple[int, ...], str]:
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # numpy or torch
        return tuple(int(d) for d in value.shape), str(value.dtype).removeprefix("torch.")
    array = np.asarray(value)
    return array.shape, array.dtype.name


def check_sample(sample: Mapping[str, Any]) -> None:
    """Raise ``InvalidInputError`` unless ``sample`` has the shapes slime's trainer requires.

    ``len(loss_mask) == response_length``; ``rollout_log_probs`` float32
    ``[response_length]``; ``rollout_routed_experts`` int32
    ``[len(tokens) - 1, L, K]``. Absent R3 fields are not checked.
    """
    missing = [key for key in (TOKENS, RESPONSE_LENGTH) if key not in sample]
    if missing:
        raise InvalidInputError(f"sample lacks {missing}")
    tokens, response = len(sample[TOKENS]), sample[RESPONSE_LENGTH]
    if not 0 <= response <= tokens:
        raise InvalidInputError(f"response_length {response} outside [0, {tokens} tokens]")
    if sample.get(LOSS_MASK) is not None and len(sample[LOSS_MASK]) != response:
        raise InvalidInputError(f"loss_mask has {len(sample[LOSS_MASK])} entries, response_length is {response}")
    if sample.get(LOG_PROBS) is not None:
        shape, dtype = _shape_dtype(sample[LOG_PROBS])
        if isinstance(sample[LOG_PROBS], Mapping) or shape != (response,) or dtype != "float32":
            raise InvalidInputError(f"{LOG_PROBS} is {dtype}{list(shape)}, slime needs float32[{response}]")
    if sample.get(ROUTED_EXPERTS_KEY) is not None:
        shape, dtype = _shape_dtype(sample[ROUTED_EXPERTS_KEY])
        if isinstance(sample[ROUTED_EXPERTS_KEY], Mapping) or len(shape) != 3 or shape[0] != tokens - 1 \
                or dtype != "int32":
            raise InvalidInputError(f"{ROUTED_EXPERTS_KEY} is {dtype}{list(shape)}, slime needs "
                                    f"int32[{tokens - 1}, L, K]")
