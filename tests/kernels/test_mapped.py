"""MappedSource: a row plan over staging bytes translated to scattered memory (host replay, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from gputq.data.packing import pack_rows, packed_row_bytes
from gputq.errors import PlanError
from gputq.kernels import MappedSource, mapped, reference_unpack_scatter, reference_widen_scatter, unpack_scatter
from gputq.kernels.host_native import host_codec, host_codec_status, widen_scatter_mapped_host
from gputq.transport.arena_copies import copy_runs
from tests.kernels.test_reference import POISON_INT, DTYPES, bits, poisoned_out, random_plan, random_staging


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 6, 384])
def test_element_plan_reads_the_same_elements_from_the_segments(dtype, width):
    rng = np.random.default_rng(width)
    src_rows, dst_rows = 400 // width + 30, 900 // width + 50
    staging = random_staging(rng, dtype, src_rows * width)
    row_bytes = width * staging.itemsize
    # Staging rows cut into segments of whole rows, scattered (out of order, with gaps) in one
    # "memory" array whose byte offsets play the device addresses.
    cuts = np.unique(np.concatenate([[0, src_rows], rng.integers(1, src_rows, 6)]))
    starts, lengths = cuts[:-1] * row_bytes, np.diff(cuts) * row_bytes
    memory = np.zeros(int(lengths.sum()) + 4096 * len(lengths), np.uint8)
    cursor = 256
    order = rng.permutation(len(starts))
    addresses = np.zeros(len(starts), np.int64)
    for i in order:
        addresses[i] = cursor
        memory[cursor:cursor + lengths[i]] = staging.view(np.uint8)[starts[i]:starts[i] + lengths[i]]
        cursor += int(lengths[i]) + 16 * int(rng.integers(0, 3))
    source = MappedSource(starts, addresses, lengths, staging.nbytes)[:staging.nbytes].view(dtype)
    assert source.size == staging.size
    # Fragments that stay inside one segment (the reader's always do: one blob each).
    plan = random_plan(rng, src_rows, dst_rows, max_frag=1)
    elements, base, src_elems = source.element_plan(plan, width)
    assert base == 256
    flat = memory[base:base + src_elems * staging.itemsize].view(dtype)
    got = reference_widen_scatter(flat, elements, 1, poisoned_out(dtype, dst_rows * width), 3)
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 3)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_fragments_outside_the_segments_are_refused():
    source = MappedSource([0, 100], [4096, 8192], [50, 50], 200).view(np.uint16)
    with pytest.raises(PlanError, match="plan row 1"):
        source.element_plan([[0, 0, 5], [20, 5, 5]], 5)  # row 20 = bytes 200..250: no segment
    with pytest.raises(PlanError, match="leading slices"):
        source[1:]
    with pytest.raises(PlanError, match="whole"):
        MappedSource([0], [0], [3], 3).view(np.uint16)


def test_spans_join_segments_closer_than_the_gap_in_memory_order():
    # segments out of memory order: 500..510, 100..112 and 112..117 (adjacent), 130..140 (13 bytes on)
    source = MappedSource([0, 16, 32, 48], [500, 100, 112, 130], [10, 12, 5, 10], 64)
    # each span at its address's offset from the first modulo 16: 130 at 30 (not 17), 500 at 48 (not 40)
    assert source.spans(max_gap=0) == ([100, 130, 500], [17, 10, 10], [48, 0, 12, 30])
    assert source.spans(max_gap=13) == ([100, 500], [40, 10], [48, 0, 12, 30])  # the gap is copied along
    assert MappedSource([], [], [], 0).spans() == ([], [], [])



@pytest.mark.parametrize("seed", range(20))
def test_random_segments_land_in_their_spans_at_their_offsets(seed):
    # Segments in any order, overlapping, repeated or far apart: copying each span back to back
    # must put every segment's bytes at its offset, and spans must be the gaps' only joins.
    rng = np.random.default_rng(seed)
    memory = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    count = int(rng.integers(1, 40))
    lengths = rng.integers(1, 600, count)
    addresses = rng.integers(0, memory.nbytes - 600, count)
    if count > 2:
        addresses[1], lengths[1] = addresses[0], lengths[0]  # the same region twice
    gap = int(rng.choice([0, 64, 4096]))
    source = MappedSource(np.cumsum(lengths) - lengths, addresses, lengths, int(lengths.sum()))
    starts, sizes, offsets = (np.array(a, np.int64) for a in source.spans(max_gap=gap))
    assert (np.diff(starts) > 0).all() and (starts[1:] > (starts + sizes)[:-1] + gap).all()
    # every segment keeps its alignment: its offset is its address's from the first span, modulo 16
    assert ((offsets - (addresses - starts[0])) % 16 == 0).all()
    packed = np.zeros(0, np.uint8)
    for a, n in zip(starts, sizes):
        packed = np.concatenate([packed, np.zeros((a - starts[0] - packed.size) % 16, np.uint8), memory[a:a + n]])
    for address, length, offset in zip(addresses, lengths, offsets):
        assert packed[offset:offset + length].tobytes() == memory[address:address + length].tobytes()


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_a_source_staged_in_host_memory_restores_the_same_values(dtype):
    rng = np.random.default_rng(7)
    width, src_rows, dst_rows = 6, 120, 200
    staging = random_staging(rng, dtype, src_rows * width)
    row_bytes = width * staging.itemsize
    # three segments of whole rows, in one "arena" out of order and with gaps of 0 and 4 KiB
    cuts = [0, 40, 90, src_rows]
    arena = np.zeros(src_rows * row_bytes + 8192, np.uint8)
    placed = {1: 0, 0: 50 * row_bytes, 2: 90 * row_bytes + 4096}
    addresses = []
    for i in range(3):
        lo, hi = cuts[i] * row_bytes, cuts[i + 1] * row_bytes
        arena[placed[i]:placed[i] + hi - lo] = staging.view(np.uint8)[lo:hi]
        addresses.append(arena.ctypes.data + placed[i])
    source = MappedSource(np.array(cuts[:-1]) * row_bytes, addresses, np.diff(cuts) * row_bytes, staging.nbytes)
    starts, lengths, _ = source.spans(max_gap=0)
    assert len(starts) == 2  # segments 1 and 0 lie back to back
    buffer = np.full(sum(lengths), 0xCD, np.uint8)
    staged = source.staged_in(lambda nbytes: buffer[:nbytes], copy_runs, max_gap=0).view(dtype)
    arena[:] = 0  # the copy no longer depends on the arena
    plan = random_plan(rng, src_rows, dst_rows, max_frag=1)
    got = staged.widen_scatter(plan, width, poisoned_out(dtype, dst_rows * width), 3)
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 3)
    np.testing.assert_array_equal(bits(got), bits(want))
    with pytest.raises(PlanError, match="needs"):
        source.staged_in(lambda nbytes: np.empty(10, np.uint8), copy_runs, max_gap=0)


def test_host_array_views_a_staging_range_where_it_lies_and_refuses_one_across_segments():
    memory = np.arange(64, dtype=np.uint16)  # two segments, stored in the other order
    base = memory.__array_interface__["data"][0]
    source = MappedSource([0, 32], [base + 64, base], [32, 32], 64).view(np.uint16)
    np.testing.assert_array_equal(source.host_array(2, 5), memory[34:39])  # staging bytes 4..14: segment 0
    np.testing.assert_array_equal(source.host_array(16, 16), memory[0:16])  # all of segment 1
    assert source.host_array(2, 5).__array_interface__["data"][0] == base + 68  # a view, not a copy
    with pytest.raises(PlanError, match="no single mapped segment"):
        source.host_array(10, 12)  # staging bytes 20..44 straddle the two


def test_a_field_whose_segments_lie_above_an_odd_aligned_one_reads_its_own_elements():
    """Two fields leased together: uint16 rows of an odd top-k put the lowest segment on 2 bytes mod 4,
    while the float32 field's segments lie 4-byte aligned above it. Its elements must still be read."""
    memory = np.zeros(256, np.uint8)
    values = np.arange(8, dtype=np.float32) + 0.5
    memory[104:136] = values.view(np.uint8)
    # staging bytes 0..6: a 3-ID uint16 row at address 66; bytes 8..40: eight float32 at address 104
    source = MappedSource([0, 8], [66, 104], [6, 32], 40)
    elements, base, src_elems = source.view(np.float32)[:10].element_plan([[2, 0, 8]], 1)
    assert base % 4 == 0 and base <= 66
    flat = memory[base:base + src_elems * 4].view(np.float32)
    out = reference_widen_scatter(flat, elements, 1, np.zeros(8, np.float32), 0)
    np.testing.assert_array_equal(out, values)


def _scattered(rng, staging: np.ndarray, row_bytes: int, src_rows: int, misalign: int = 0):
    """``staging``'s rows cut into segments of whole rows, copied out of order (with gaps) into one host
    buffer; returns the buffer (keep it alive) and the segments' (starts, addresses, lengths)."""
    cuts = np.unique(np.concatenate([[0, src_rows], rng.integers(1, src_rows, 6)]))
    starts, lengths = cuts[:-1] * row_bytes, np.diff(cuts) * row_bytes
    memory = np.zeros(int(lengths.sum()) + 4096 * len(lengths), np.uint8)
    addresses, cursor = np.zeros(len(starts), np.int64), 256 + misalign
    for i in rng.permutation(len(starts)):
        addresses[i] = memory.ctypes.data + cursor
        memory[cursor:cursor + lengths[i]] = staging.view(np.uint8)[starts[i]:starts[i] + lengths[i]]
        cursor += int(lengths[i]) + 16 * int(rng.integers(0, 3))
    return memory, (starts.astype(np.int64), addresses, lengths.astype(np.int64))


@pytest.mark.skipif(host_codec() is None, reason=f"no host codec: {host_codec_status()}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 6, 384])
def test_the_codec_reads_each_row_from_its_segment_where_it_lies(dtype, width):
    rng = np.random.default_rng(7 * width)
    src_rows, dst_rows = 400 // width + 30, 900 // width + 50
    staging = random_staging(rng, dtype, src_rows * width)
    memory, segments = _scattered(rng, staging, width * staging.itemsize, src_rows)
    # Half of each segment from its first row on, a fill row after each, then single rows from anywhere.
    row_bytes = width * staging.itemsize
    rows, cursor = [], 0
    for first, size in zip(segments[0] // row_bytes, segments[2] // row_bytes):
        rows += [(int(first), cursor, max(1, int(size) // 2)), (-1, cursor + max(1, int(size) // 2), 1)]
        cursor += max(1, int(size) // 2) + 1
    rows += [(int(r), cursor + i, 1) for i, r in enumerate(rng.integers(0, src_rows, dst_rows - cursor))]
    plan = np.array(rows, np.int64)[rng.permutation(len(rows))]
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 3)
    got = widen_scatter_mapped_host(segments, dtype, plan, width, poisoned_out(dtype, dst_rows * width), 3)
    np.testing.assert_array_equal(bits(got), bits(want))
    source = MappedSource(*segments, staging.nbytes).view(dtype)
    through = source.widen_scatter(plan, width, poisoned_out(dtype, dst_rows * width), 3, validate=False)
    np.testing.assert_array_equal(bits(through), bits(want))
    del memory


@pytest.mark.skipif(host_codec() is None, reason=f"no host codec: {host_codec_status()}")
def test_the_codec_refuses_a_row_across_segments_misaligned_or_outside_and_writes_nothing_from_it_on():
    staging = np.arange(100, dtype=np.uint16)  # 20 rows of 5
    memory = np.zeros(8192, np.uint8)
    base = memory.ctypes.data
    memory[256:356] = staging[:50].view(np.uint8)
    memory[1024:1124] = staging[50:].view(np.uint8)
    segments = (np.array([0, 100]), np.array([base + 256, base + 1024]), np.array([100, 100]))
    for plan, row in [([[0, 0, 2], [8, 2, 4], [12, 6, 1]], 1),  # rows 8..11: bytes 80..120, two segments
                      ([[0, 0, 2], [12, 9, 2]], 1),  # out has 10 rows
                      ([[0, 0, 2], [20, 2, 1]], 1)]:  # row 20: past the last segment
        out = poisoned_out("uint16", 50)
        with pytest.raises(PlanError, match=f"plan row {row} "):
            widen_scatter_mapped_host(segments, "uint16", plan, 5, out)
        np.testing.assert_array_equal(out[:10], staging[:10])
        assert (out[10:] == POISON_INT).all()
    odd = (segments[0], segments[1] + 1, segments[2])
    with pytest.raises(PlanError, match="plan row 0 "):
        widen_scatter_mapped_host(odd, "uint16", [[0, 0, 1]], 5, poisoned_out("uint16", 50))
    assert widen_scatter_mapped_host(segments, "int8", [[0, 0, 1]], 5, np.zeros(50, np.int32)) is None


def _packed_rows(rng, topk: int, bits: int, rows: int) -> np.ndarray:
    """``rows`` random packed rows of ``topk`` IDs of ``bits`` bits, as uint8 staging."""
    return pack_rows(rng.integers(0, 1 << bits, (rows, topk)).astype(np.int32), 1 << bits).reshape(-1)


@pytest.mark.parametrize("path", ["codec", "numpy"])
@pytest.mark.parametrize("topk,bits", [(1, 1), (8, 7), (8, 9), (10, 9), (4, 16), (13, 11)])
def test_packed_rows_unpack_from_their_segments_where_they_lie(monkeypatch, path, topk, bits):
    """Packed rows of any byte length, cut into segments scattered out of order (odd addresses: a row of
    packed IDs may end on any byte), unpack through ``unpack_scatter`` into what the reference gives over
    the contiguous staging; by the codec, and row by row in numpy where it cannot be loaded."""
    if path == "codec" and host_codec() is None:
        pytest.skip(f"no host codec: {host_codec_status()}")
    if path == "numpy":
        monkeypatch.setattr(mapped, "unpack_scatter_mapped_host", lambda *args: None)
    rng = np.random.default_rng(topk * 17 + bits)
    row_bytes, src_rows, dst_rows = packed_row_bytes(topk, bits), 300, 500
    staging = _packed_rows(rng, topk, bits, src_rows)
    memory, segments = _scattered(rng, staging, row_bytes, src_rows, misalign=3)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=1)
    want = reference_unpack_scatter(staging, plan, topk, bits, poisoned_out("uint8", dst_rows * topk), 5)
    source = MappedSource(*segments, staging.nbytes)
    got = unpack_scatter(source, plan, topk, bits, poisoned_out("uint8", dst_rows * topk), 5, validate=False)
    np.testing.assert_array_equal(got, want)
    del memory


@pytest.mark.parametrize("path", ["codec", "numpy"])
def test_packed_rows_across_segments_or_outside_are_refused_and_nothing_from_them_on_is_written(monkeypatch,
                                                                                              path):
    if path == "codec" and host_codec() is None:
        pytest.skip(f"no host codec: {host_codec_status()}")
    if path == "numpy":
        monkeypatch.setattr(mapped, "unpack_scatter_mapped_host", lambda *args: None)
    topk, bits = 8, 9  # rows of 9 bytes
    staging = _packed_rows(np.random.default_rng(1), topk, bits, 20)
    memory = np.zeros(4096, np.uint8)
    memory[101:191] = staging[:90]
    memory[1001:1091] = staging[90:]
    segments = (np.array([0, 90]), np.array([memory.ctypes.data + 101, memory.ctypes.data + 1001]),
                np.array([90, 90]))
    source = MappedSource(*segments, staging.nbytes)
    want = reference_unpack_scatter(staging, [[0, 0, 2]], topk, bits, poisoned_out("uint8", 10 * topk))
    for plan in ([[0, 0, 2], [8, 2, 4]],  # rows 8..11: bytes 72..108, two segments
                 [[0, 0, 2], [12, 9, 2]],  # out has 10 rows
                 [[0, 0, 2], [20, 2, 1]]):  # row 20: past the last segment
        out = poisoned_out("uint8", 10 * topk)
        with pytest.raises(PlanError, match="plan row 1 "):
            unpack_scatter(source, plan, topk, bits, out, validate=False)
        np.testing.assert_array_equal(out[:2 * topk], want[:2 * topk])
        assert (out[2 * topk:] == POISON_INT).all()
    with pytest.raises(PlanError, match="whole rows"):
        unpack_scatter(source[:100], [[0, 0, 1]], topk, bits, poisoned_out("uint8", 10 * topk))
    with pytest.raises(PlanError, match="host memory only"):
        unpack_scatter(source, [[0, 0, 1]], topk, bits, _NotNumpy())
    del memory


class _NotNumpy:
    """An ``out`` that is not a numpy array (a CUDA tensor's place)."""
