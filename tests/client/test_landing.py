"""Widening chunks as they land must give exactly what the widen of the whole staged micro-batch gives."""

from __future__ import annotations

import numpy as np
import pytest

from gputq.client.landing import LandingWidener
from gputq.client.plan import SpanRequest
from gputq.client.plan_fields import FieldPlan
from gputq.errors import TransferError
from gputq.kernels import reference_widen_scatter


def _plan(rng, src_rows: int, dst_rows: int) -> np.ndarray:
    """Plan rows over every target row: runs of stored rows (sources may repeat and overlap) and fill runs."""
    rows, cursor = [], 0
    while cursor < dst_rows:
        n = int(min(rng.integers(1, 24), dst_rows - cursor))
        if rng.random() < 0.2:
            rows.append((-1, cursor, n))
        elif rng.random() < 0.9:  # some target rows stay uncovered
            rows.append((int(rng.integers(0, src_rows - n + 1)), cursor, n))
        cursor += n + int(rng.random() < 0.1)
    return np.array(rows, np.int64)


def _field(name, stored, restored, width, plan, fill, dst_rows) -> FieldPlan:
    return FieldPlan(name, np.dtype(stored), np.dtype(restored), width, plan, fill, dst_rows * width, (), 0, dst_rows)


@pytest.mark.parametrize("chunk", [16, 48, 4096, 1 << 20])
@pytest.mark.parametrize("seed", range(4))
def test_chunks_widened_as_they_land_equal_the_staged_widen(seed, chunk):
    rng = np.random.default_rng(seed)
    # Two fields back to back in one micro-batch's staging, as the stream places them: R3 rows of
    # uint16 (width 8), then logprobs (float32) from a 16-byte boundary; one read each.
    experts_rows, logprob_rows = 300, 77
    staging = np.zeros(experts_rows * 16 + 16 + logprob_rows * 4, np.uint8)
    experts = rng.integers(0, 1 << 16, experts_rows * 8, dtype=np.uint16)
    staging[:experts.nbytes] = experts.view(np.uint8)
    second = experts.nbytes + 16
    logprobs = -rng.random(logprob_rows, dtype=np.float32)
    staging[second:second + logprobs.nbytes] = logprobs.view(np.uint8)
    fields = [_field("routed_experts", np.uint16, np.int32, 8, _plan(rng, experts_rows, 500), 7, 500),
              _field("logprobs", np.float32, np.float32, 1, _plan(rng, logprob_rows, 120) + [second // 4, 0, 0], 0.5,
                     120)]
    fields[1].plan[fields[1].plan[:, 0] - second // 4 < 0, 0] = -1  # fill rows stay fill rows
    compact = [staging[:experts.nbytes].view(np.uint16), staging[:(second + logprobs.nbytes)].view(np.float32)]
    want = [np.full(fp.out_elements, -99, fp.restored) for fp in fields]
    for fp, source, out in zip(fields, compact, want):
        reference_widen_scatter(source, fp.plan, fp.width, out, fp.fill)
    got = [np.full(fp.out_elements, -99, fp.restored) for fp in fields]
    reads = [(0, experts.nbytes), (second, second + logprobs.nbytes)]
    widener = LandingWidener(list(zip(fields, got)), reads)
    widener.fill()
    for start, stop in reads:
        sink = widener.sink(start, stop)
        for offset in range(0, stop - start, chunk):
            sink(offset, staging[start + offset:min(stop, start + offset + chunk)].copy())  # a reused buffer's bytes
    for out, reference in zip(got, want):
        np.testing.assert_array_equal(out, reference)
    assert (got[0] == -99).any() or (got[1] == -99).any()  # uncovered rows are left as they were


def test_a_sink_sees_only_the_plan_rows_of_its_read():
    fp = _field("routed_experts", np.uint8, np.int32, 4, np.array([[0, 0, 2], [2, 2, 2]], np.int64), 0, 4)
    out = np.zeros(16, np.int32)
    # The two rows follow each other in staging and in the output, but come from two reads.
    widener = LandingWidener([(fp, out)], [(0, 8), (8, 16)])
    widener.sink(8, 16)(0, np.arange(10, 18, dtype=np.uint8))  # the second read: stored rows 2 and 3
    np.testing.assert_array_equal(out, [0] * 8 + list(range(10, 18)))


@pytest.mark.parametrize("chunk", [16, 48, 208])
def test_rows_that_follow_each_other_are_widened_as_one_across_chunks(chunk):
    # A rank's two CP chunks of each layer land back to back and fill adjacent output tokens
    # (merged into one copy per layer); between layers the output jumps to the next layer's tokens.
    layers, first, second, width = 3, 5, 4, 8
    rows = first + second
    plan = np.array([(layer * rows + part, layer * (rows + 1) + part, n)
                     for layer in range(layers) for part, n in ((0, first), (first, second))], np.int64)
    fp = _field("routed_experts", np.uint16, np.int32, width, plan, 0, layers * (rows + 1))
    staging = np.arange(layers * rows * width, dtype=np.uint16).view(np.uint8)
    want = np.full(fp.out_elements, -1, np.int32)
    reference_widen_scatter(staging.view(np.uint16), plan, width, want, 0)
    got = np.full(fp.out_elements, -1, np.int32)
    sink = LandingWidener([(fp, got)], [(0, staging.nbytes)]).sink(0, staging.nbytes)
    for offset in range(0, staging.nbytes, chunk):
        sink(offset, staging[offset:offset + chunk].copy())
    np.testing.assert_array_equal(got, want)
    assert (got.reshape(layers, rows + 1, width)[:, rows] == -1).all()  # the pad row is the stream's to write


def test_a_reply_whose_lengths_miss_the_request_bytes_is_refused_naming_unit_and_keys():
    request = SpanRequest("su-1", "inc", 32, 96, ["a", "b"], [1, 1], np.array([[0, 0, 32], [1, 0, 32]], np.int64))
    request.check_lengths([32, 32])
    with pytest.raises(TransferError, match="unit su-1 returned 48 bytes for 2 spans of 2 keys, expected 64") as info:
        request.check_lengths([32, 16])
    assert info.value.unit == "su-1" and info.value.keys == ("a", "b")


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_a_cp_ranks_planned_reads_land_one_copy_per_layer_and_sample(cp_rank):
    """The planner lays each key's reads out layer after layer, the rank's zigzag chunks of a layer back to
    back: they then land as they go to the layer's output, merged into one copy, and widen exactly."""
    from gputq.client.plan import plan_stream
    from gputq.data.refs import FieldRef, Layout
    from gputq.data.slices import ParallelSlice, expert_pieces

    layers, topk, rows = 6, 4, 63  # tokens 64: four zigzag chunks of 16 (the last 15 rows) for CP 2
    stored = [np.random.default_rng(i).integers(0, 1 << 16, (rows, layers, topk)).astype(np.uint16)
              for i in range(2)]
    refs = [FieldRef(key=f"k{i}", field="routed_experts", unit="su-0", rows=rows, dtype="uint16",
                     row_shape=(layers, topk), partition="p") for i in range(2)]
    shard = [{"routed_experts": Layout.from_ref(ref)} for ref in refs]
    rank = ParallelSlice(layers=range(1, 5), cp_rank=cp_rank, cp_size=2, num_experts=1 << 16)
    plan = plan_stream(shard, [[0, 1]], rank)[0].finish()
    (request,) = plan.requests
    # CP rank 0 keeps a sample's first and last chunks: a layer's last and the next layer's first lie back
    # to back in the stored blob, and go out as one span.
    assert len(request.spans) == len(shard) * (len(rank.layers) + (cp_rank == 0))
    blobs = [np.ascontiguousarray(s.transpose(1, 0, 2)).view(np.uint8).reshape(-1) for s in stored]  # layer-major
    reply = np.concatenate([blobs[k][offset:offset + n] for k, offset, n in request.spans.tolist()])
    fp = plan.fields["routed_experts"]
    want = np.full(fp.out_elements, -1, np.int32)
    reference_widen_scatter(reply.view(np.uint16), fp.plan, fp.width, want, fp.fill)
    got = np.full(fp.out_elements, -1, np.int32)
    widener = LandingWidener([(fp, got)], [(request.start, request.stop)])
    assert len(widener._reads[(request.start, request.stop)]) == len(rank.layers) * len(shard)
    sink = widener.sink(request.start, request.stop)
    for offset in range(0, reply.nbytes, 96):
        sink(offset, reply[offset:offset + 96].copy())
    np.testing.assert_array_equal(got, want)
    pieces = [(p, a, b) for p, a, b in expert_pieces([rows] * len(shard), rank) if p >= 0]
    shaped = got.reshape(len(rank.layers), -1, topk)
    for j, layer in enumerate(rank.layers):  # the stored routes of the rank's chunks, layer by layer
        kept = np.concatenate([stored[p][a:b, layer] for p, a, b in pieces])
        np.testing.assert_array_equal(shaped[j][shaped[j, :, 0] >= 0], kept)
