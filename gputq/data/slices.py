"""What one trainer rank consumes of a sample: its layers, its tokens, and slime's padding.

A pipeline stage needs only its own MoE layers; a context-parallel rank only
its token chunks (zigzag: two per sample); a sequence-parallel rank only its
share of the micro-batch. :class:`ParallelSlice` names a rank's place, and
the functions here turn it into row pieces of each sample, exactly as slime
prepares routed experts for Megatron's router replay:

1. every sample's ``[T-1, L, K]`` rows get one pad row (``T`` rows);
2. with zigzag CP, each sample is padded to ``2 * cp_size`` equal chunks
   and the rank keeps chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``;
3. the micro-batch's samples are concatenated and padded to a multiple of
   ``tp_size * pad_multiple`` rows; with allgather CP instead, the whole
   concatenation is padded to a multiple of ``cp_size * tp_size *
   pad_multiple`` rows and the rank keeps its contiguous ``1 / cp_size``
   (a chunk that crosses sample boundaries, pad rows counted);
4. with sequence parallelism, the rank keeps its ``1 / tp_size`` of them.

Every pad block holds ``arange(rows * L * K) % num_experts`` (not expert 0),
each block counted from 0. Logprobs are cut by the logits offsets of the
zigzag chunks in both CP modes (``rollout_log_probs`` is response-only):
slime cuts them so before training, and with allgather CP redistributes the
log-probs it computes to that same zigzag layout before comparing them.

How slices meet storage: a blob whose rows have two or more dimensions (R3's
``[L, K]``) is stored *layer-major*, its first row dimension outermost
(``[L, rows, K]``), so a stage's layers over a token range are one
contiguous run per layer; other blobs are stored row after row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gputq.errors import InvalidInputError

__all__ = ["ParallelSlice", "layer_major", "stored_shape", "zigzag_chunks", "expert_pieces", "logprob_ranges",
           "pad_block", "blob_spans"]

#: A piece of a micro-batch's rows: ``(sample, start, stop)`` rows of that sample, or
#: ``(-1, start, stop)`` pad rows numbered ``start..stop-1`` within their pad block.
Piece = tuple[int, int, int]


def layer_major(row_shape: Sequence[int]) -> bool:
    """Whether blobs of rows shaped ``row_shape`` are stored with the first row dimension outermost."""
    return len(row_shape) >= 2


def stored_shape(rows: int, row_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a blob of ``rows`` rows of ``row_shape`` has in the arena."""
    if layer_major(row_shape):
        return (row_shape[0], rows, *row_shape[1:])
    return (rows, *row_shape)


def _int(name: str, value, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidInputError(f"ParallelSlice.{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _layer_tuple(layers) -> tuple:
    """``layers`` as a tuple, or ``()`` (refused by the caller) where it is not an iterable of them."""
    try:
        return tuple(layers)
    except TypeError:
        return ()


@dataclass(frozen=True)
class ParallelSlice:
    """One trainer rank's place in the parallel layout.

    Parameters
    ----------
    layers:
        The stored layers (first row dimension of R3, the model's layer
        index) this rank's pipeline stage replays, ascending: a ``range`` or
        a tuple of indices (its MoE layers only, say). ``None``: all.
    cp_rank, cp_size:
        Context-parallel position (slime's ``thd`` layout).
    allgather_cp:
        slime's ``--allgather-cp``: the rank's R3 rows are one contiguous
        chunk of the micro-batch's concatenation instead of two zigzag
        chunks per sample.
    tp_rank, tp_size, sequence_parallel:
        Tensor-parallel position; with ``sequence_parallel`` the rank keeps
        its ``1 / tp_size`` of each micro-batch's rows.
    pad_multiple:
        slime's ``data_pad_size_multiplier``: a micro-batch is padded to a
        multiple of ``tp_size * pad_multiple`` rows.
    num_experts:
        Experts per MoE layer; pad rows hold ``arange % num_experts``.
        Required for R3; where the IDs were stored with a count (packed,
        or whole bytes under a configured ``num_experts``), that count
        (another is refused).
    """

    layers: range | tuple[int, ...] | None = None
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    sequence_parallel: bool = False
    pad_multiple: int = 1
    num_experts: int | None = None
    allgather_cp: bool = False

    def __post_init__(self) -> None:
        for name, low in (("cp_rank", 0), ("cp_size", 1), ("tp_rank", 0), ("tp_size", 1), ("pad_multiple", 1)):
            object.__setattr__(self, name, _int(name, getattr(self, name), low))
        if self.cp_rank >= self.cp_size or self.tp_rank >= self.tp_size:
            raise InvalidInputError(f"ParallelSlice: cp_rank {self.cp_rank} of {self.cp_size}, tp_rank "
                                    f"{self.tp_rank} of {self.tp_size}: a rank must be below its size")
        for name in ("sequence_parallel", "allgather_cp"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"ParallelSlice.{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_experts is not None:
            object.__setattr__(self, "num_experts", _int("num_experts", self.num_experts, 1))
        if self.layers is not None:
            layers = _layer_tuple(self.layers)
            if not layers or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
                                 for v in layers) or any(b <= a for a, b in zip(layers, layers[1:])) \
                    or layers[0] < 0:
                raise InvalidInputError(f"ParallelSlice.layers must be ascending non-negative layer indices, "
                                        f"got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(int(v) for v in layers))

    def layer_indices(self, stored_layers: int, where: str) -> tuple[int, ...]:
        """The stored layers this rank reads of a field with ``stored_layers``; else ``InvalidInputError``."""
        if self.layers is None:
            return tuple(range(stored_layers))
        outside = [layer for layer in self.layers if layer >= stored_layers]
        if outside:
            named = f"layer {outside[0]} is" if len(outside) == 1 else f"layers {outside[0]}..{outside[-1]} are"
            raise InvalidInputError(f"{where}: {named} past the {stored_layers} stored layers "
                                    f"(0..{stored_layers - 1})")
        return self.layers


def zigzag_chunks(tokens: int, cp_rank: int, cp_size: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """slime's zigzag CP chunks of a ``tokens``-row sequence: ``(chunk, (first, second))``.

    The sequence is padded to ``2 * cp_size * chunk`` rows; ranges are in
    those padded rows. With ``cp_size == 1`` the one range is the sequence.
    """
    if cp_size == 1:
        return tokens, ((0, tokens),)
    chunk = -(-tokens // (2 * cp_size))
    return chunk, ((cp_rank * chunk, (cp_rank + 1) * chunk),
                   ((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk))


def _sample_pieces(sample: int, rows: int, ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """Pieces of the padded rows ``ranges`` of a sample with ``rows`` stored rows.

    Row ``rows`` is the one pad row (pad 0 of its block); rows past it are
    the CP pad block, numbered from 0.
    """
    pieces: list[Piece] = []
    for start, stop in ranges:
        if start < rows:
            pieces.append((sample, start, min(stop, rows)))
        if start <= rows < stop:
            pieces.append((-1, 0, 1))
        if stop > rows + 1:
            pieces.append((-1, max(start, rows + 1) - rows - 1, stop - rows - 1))
    return pieces


def _cut(pieces: list[Piece], start: int, stop: int) -> list[Piece]:
    """Rows ``[start, stop)`` of the concatenated ``pieces``."""
    out: list[Piece] = []
    cursor = 0
    for sample, a, b in pieces:
        lo, hi = max(start, cursor), min(stop, cursor + b - a)
        if lo < hi:
            out.append((sample, a + lo - cursor, a + hi - cursor))
        cursor += b - a
    return out


def expert_pieces(rows: Sequence[int], rank: ParallelSlice) -> list[Piece]:
    """The rows of one micro-batch's R3 this rank replays, in order, as pieces.

    ``rows`` holds each sample's stored rows (``T - 1``); samples are
    numbered by their position in ``rows``.
    """
    allgather = rank.allgather_cp and rank.cp_size > 1
    pieces: list[Piece] = []
    for sample, n in enumerate(rows):
        _, ranges = zigzag_chunks(n + 1, 0, 1) if allgather else zigzag_chunks(n + 1, rank.cp_rank, rank.cp_size)
        pieces.extend(_sample_pieces(sample, n, ranges))
    total = sum(b - a for _, a, b in pieces)
    pad_size = rank.tp_size * rank.pad_multiple * (rank.cp_size if allgather else 1)
    pad = (pad_size - total % pad_size) % pad_size
    if pad:
        pieces.append((-1, 0, pad))
        total += pad
    if allgather:  # the rank's contiguous chunk of the whole micro-batch, pad rows counted
        chunk = total // rank.cp_size
        pieces, total = _cut(pieces, chunk * rank.cp_rank, chunk * (rank.cp_rank + 1)), chunk
    if rank.sequence_parallel and rank.tp_size > 1:
        share = total // rank.tp_size  # a multiple of tp_size by the padding above
        pieces = _cut(pieces, share * rank.tp_rank, share * (rank.tp_rank + 1))
    return pieces


def logprob_ranges(total_length: int, response_length: int, cp_rank: int, cp_size: int) -> list[tuple[int, int]]:
    """The ranges of a sample's response logprobs a CP rank keeps (slime's logits offsets)."""
    if cp_size == 1:
        return [(0, response_length)]
    _, chunks = zigzag_chunks(total_length, cp_rank, cp_size)
    prompt = total_length - response_length
    ranges = []
    for start, stop in chunks:
        lo, hi = max(start, prompt - 1), min(stop, total_length - 1)
        if lo < hi:
            ranges.append((lo - (prompt - 1), hi - (prompt - 1)))
    return ranges


def pad_block(start: int, stop: int, layers: Sequence[int], stored_layers: int, topk: int,
              num_experts: int) -> np.ndarray:
    """Pad rows ``start..stop-1`` of a pad block as int32 ``[len(layers), rows, topk]``.

    Pad row ``p``, layer ``l``, slot ``k`` holds ``(p * L * K + l * K + k) % num_experts``:
    slime's ``arange(rows * L * K).reshape(rows, L, K) % num_experts``.
    """
    p = np.arange(start, stop, dtype=np.int64)[None, :, None]
    layer = np.asarray(layers, dtype=np.int64)[:, None, None]
    k = np.arange(topk, dtype=np.int64)[None, None, :]
    return ((p * stored_layers * topk + layer * topk + k) % num_experts).astype(np.int32)


def blob_spans(rows: int, row_shape: Sequence[int], itemsize: int, runs: Sequence[tuple[int, int]],
               layers: Sequence[int] | None) -> list[tuple[int, int]]:
    """Byte ``(offset, nbytes)`` spans of row ``runs`` (sorted, disjoint ``(start, stop)``) in a stored blob.

    Layer-major blobs give the runs of each layer back to back, layer after
    layer (of ``layers``), adjacent spans merged: a rank's CP chunks of one
    layer then follow each other in the reply as in the layer's output.
    Other blobs give one span per run, and take no ``layers``.
    """
    if not layer_major(row_shape):
        row = math.prod(row_shape) * itemsize
        return [(start * row, (stop - start) * row) for start, stop in runs]
    inner = math.prod(row_shape[1:]) * itemsize
    spans: list[tuple[int, int]] = []
    for layer in (range(row_shape[0]) if layers is None else layers):
        for start, stop in runs:
            offset, nbytes = (layer * rows + start) * inner, (stop - start) * inner
            if spans and spans[-1][0] + spans[-1][1] == offset:
                spans[-1] = (spans[-1][0], spans[-1][1] + nbytes)
            else:
                spans.append((offset, nbytes))
    return spans
