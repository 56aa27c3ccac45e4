"""slime's allgather CP mode, streamed: each rank's contiguous chunk of the micro-batch, nothing else moved."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.packing import bits_for, packed_row_bytes
from gputq.data.slices import ParallelSlice, expert_pieces
from gputq.errors import InvalidInputError
from tests.client.test_stream import EXPERTS
from tests.client.test_stream import _rollout as rollout
from tests.conftest import TRANSPORT_PARAMS, local_units

pytestmark = pytest.mark.timeout(180)

LAYERS, TOPK = 4, 3  # an odd top-k: uint16 rows of 6 bytes, packed ones of 12 bits in 2 bytes
#: Stored bytes of one layer's row: uint16, and packed at 4 bits an ID (EXPERTS is 16).
ROW_BYTES = {"uint16": TOPK * 2, "packed": packed_row_bytes(TOPK, bits_for(EXPERTS))}
#: Uneven lengths, so that chunks cross sample boundaries and pads land mid-chunk.
LENGTHS = [37, 50, 9, 64, 23, 41]
BATCHES = [[0, 1, 2], [3], [4, 5]]
#: The issue's grid: CP 2 and 4, TP 1 and 2, sequence parallelism on and off, pad multipliers 1 and 4.
GRID = list(itertools.product((2, 4), (1, 2), (False, True), (1, 4)))


def _pad_block(rows: int, layers: int = LAYERS, topk: int = TOPK, experts: int = EXPERTS) -> np.ndarray:
    """slime's pad rows: ``arange(rows * L * K) % num_experts``, shaped ``[rows, L, K]``."""
    return (np.arange(rows * layers * topk) % experts).reshape(rows, layers, topk).astype(np.int32)


def allgather_rows(samples: list[np.ndarray], cp_size: int, cp_rank: int, tp_size: int, tp_rank: int,
                   sequence_parallel: bool, pad_multiple: int, experts: int = EXPERTS) -> np.ndarray:
    """slime's rule for ``--allgather-cp``, stated on whole numpy arrays: ``[tokens, L, K]`` of one rank.

    Each sample gets one pad row; the samples are concatenated; the whole is
    padded to a multiple of ``cp_size * tp_size * pad_multiple``; the rank
    keeps its ``1 / cp_size`` chunk, then its sequence-parallel share.
    """
    shape = samples[0].shape[1:]  # [L, K]
    rows = np.concatenate([np.concatenate([s, _pad_block(1, *shape, experts)]) for s in samples])
    size = cp_size * tp_size * pad_multiple
    rows = np.concatenate([rows, _pad_block((size - len(rows) % size) % size, *shape, experts)])
    rows = np.split(rows, cp_size)[cp_rank]
    if sequence_parallel:
        rows = np.split(rows, tp_size)[tp_rank]
    return rows


def zigzag_log_probs(log_probs: np.ndarray, total: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """slime's cut of response logprobs under CP (both modes: it redistributes allgather's to zigzag)."""
    chunk = -(-total // (2 * cp_size))
    prompt = total - len(log_probs)
    parts = []
    for start, stop in ((cp_rank * chunk, (cp_rank + 1) * chunk),
                        ((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk)):
        lo, hi = max(start, prompt - 1), min(stop, total - 1)
        if lo < hi:
            parts.append(log_probs[lo - (prompt - 1):hi - (prompt - 1)])
    return np.concatenate(parts) if parts else log_probs[:0]


def _stored_rows_of_chunk(lengths: list[int], rank: ParallelSlice) -> int:
    """Stored R3 rows (not pads) in the rank's rows, counted from a mask run through the same rule."""
    masks = [np.ones((n - 1, LAYERS, TOPK), np.int32) for n in lengths]
    got = allgather_rows([m + EXPERTS for m in masks], rank.cp_size, rank.cp_rank, rank.tp_size, rank.tp_rank,
                         rank.sequence_parallel, rank.pad_multiple)
    return int((got[:, 0, 0] >= EXPERTS).sum())  # pads hold IDs below EXPERTS


def _rollout(writer, rng):
    return rollout(writer, rng, LENGTHS, layers=LAYERS, topk=TOPK)


def test_the_rule_matches_slime_on_whole_arrays_for_every_rank():
    """expert_pieces' allgather rows, materialised, equal the numpy statement of slime's rule."""
    rng = np.random.default_rng(3)
    samples = [rng.integers(EXPERTS, 2 * EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.int32) for n in LENGTHS]
    for cp, tp, sp, pad in GRID:
        for cp_rank, tp_rank in itertools.product(range(cp), range(tp)):
            rank = ParallelSlice(cp_rank=cp_rank, cp_size=cp, tp_rank=tp_rank, tp_size=tp, sequence_parallel=sp,
                                 pad_multiple=pad, num_experts=EXPERTS, allgather_cp=True)
            parts = [samples[s][a:b] if s >= 0 else _pad_block(b)[a:] for s, a, b in
                     expert_pieces([len(s) for s in samples], rank)]
            want = allgather_rows(samples, cp, cp_rank, tp, tp_rank, sp, pad)
            np.testing.assert_array_equal(np.concatenate(parts), want, err_msg=str(rank))


@pytest.mark.parametrize("dtype", sorted(ROW_BYTES))
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_every_rank_streams_slimes_allgather_rows_and_moves_exactly_its_slice(transport, dtype):
    with local_units(transport, units=2, routed_experts_dtype=dtype, num_experts=EXPERTS) as (config, units, clients):
        with Writer(clients, config) as writer:
            shard, data = _rollout(writer, np.random.default_rng(11))
        with Reader(clients, config) as reader:
            for cp, tp, sp, pad in GRID:
                for cp_rank, tp_rank in itertools.product(range(cp), range(tp if sp else 1)):
                    rank = ParallelSlice(layers=range(1, 3), cp_rank=cp_rank, cp_size=cp, tp_rank=tp_rank,
                                         tp_size=tp, sequence_parallel=sp, pad_multiple=pad, num_experts=EXPERTS,
                                         allgather_cp=True)
                    before = sum(unit.stats()["bytes_read"] for unit in units)
                    want_bytes = 0
                    with reader.stream(shard, BATCHES, rank) as stream:
                        for mb in stream:
                            batch = BATCHES[mb.index]
                            want = allgather_rows([data[i][0] for i in batch], cp, cp_rank, tp, tp_rank, sp, pad)
                            assert mb.layers == (1, 2)
                            for j, layer in enumerate(mb.layers):
                                assert mb.routed_experts[j].dtype == np.int32
                                np.testing.assert_array_equal(mb.routed_experts[j], want[:, layer], err_msg=str(rank))
                            for i, lp in zip(batch, mb.log_probs):
                                np.testing.assert_array_equal(lp, zigzag_log_probs(data[i][1], data[i][2], cp,
                                                                                   cp_rank))
                                want_bytes += 4 * len(lp)
                            stored = _stored_rows_of_chunk([LENGTHS[i] for i in batch], rank)
                            want_bytes += stored * 2 * ROW_BYTES[dtype]
                    moved = sum(unit.stats()["bytes_read"] for unit in units) - before
                    assert moved == want_bytes, rank


def test_allgather_bad_input_is_refused_naming_the_micro_batch():
    with local_units("tcp", units=1) as (config, _units, clients):
        with Writer(clients, config) as writer:
            shard, _ = _rollout(writer, np.random.default_rng(5))
        with Reader(clients, config) as reader:
            no_experts = ParallelSlice(cp_size=2, allgather_cp=True)
            with pytest.raises(InvalidInputError, match=r"micro-batch 0, field 'routed_experts'.*num_experts"):
                reader.stream(shard, BATCHES, no_experts)
            rank = ParallelSlice(cp_size=2, allgather_cp=True, num_experts=EXPERTS)
            with pytest.raises(InvalidInputError, match="token_ranges replace the CP rule"):
                reader.stream(shard, BATCHES, rank, token_ranges=[[(0, 4)]] * len(shard))
            with pytest.raises(InvalidInputError, match=r"micro-batch 1, sample 3: field 'logprobs' has 32 rows"):
                reader.stream(shard, BATCHES, rank, fields=["logprobs"], total_lengths=[n if i != 3 else 20 for i, n in
                                                                                          enumerate(LENGTHS)])
    with pytest.raises(InvalidInputError, match="allgather_cp must be a bool"):
        ParallelSlice(cp_size=2, allgather_cp=1)
