"""FreeListAllocator: fill/free, coalescing, fragmentation, random stress against a model."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputq.errors import InvalidInputError
from gputq.unit.allocator import FreeListAllocator


def test_fill_then_free_restores_one_block():
    alloc = FreeListAllocator(4096, alignment=256)
    offsets = [alloc.allocate(256) for _ in range(16)]
    assert offsets == [i * 256 for i in range(16)]
    assert alloc.allocate(1) is None
    assert alloc.free_bytes == 0 and alloc.used_bytes == 4096 and alloc.largest_free == 0
    for off in offsets[::-1]:
        alloc.free(off)
    assert alloc.num_free_blocks == 1
    assert alloc.largest_free == alloc.free_bytes == 4096
    assert alloc.fragmentation == 0.0


def test_sizes_round_up_and_capacity_rounds_down():
    alloc = FreeListAllocator(1000, alignment=256)
    assert alloc.capacity == 768
    assert alloc.block_size(1) == 256 and alloc.block_size(257) == 512
    assert alloc.fits_ever(768) and not alloc.fits_ever(769)
    off = alloc.allocate(300)
    assert off == 0 and alloc.size_of(off) == 512 and alloc.used_bytes == 512
    assert alloc.allocate(300) is None
    assert alloc.allocate(256) == 512


def test_zero_byte_allocations_get_distinct_offsets():
    alloc = FreeListAllocator(1024, alignment=256)
    a, b = alloc.allocate(0), alloc.allocate(0)
    assert a != b and {a, b} <= {0, 256, 512, 768}
    assert alloc.used_bytes == 512  # one unit each: bounded like everything else
    alloc.free(a)
    alloc.free(b)
    assert alloc.free_bytes == 1024 and alloc.num_free_blocks == 1


def test_coalesces_with_both_neighbours():
    alloc = FreeListAllocator(1024, alignment=256)
    a, b, c, d = (alloc.allocate(256) for _ in range(4))
    alloc.free(a)
    alloc.free(c)
    assert alloc.num_free_blocks == 2 and alloc.largest_free == 256
    alloc.free(b)  # merges a, b, c
    assert alloc.num_free_blocks == 1 and alloc.largest_free == 768
    alloc.free(d)
    assert alloc.largest_free == 1024


def test_fragmentation_blocks_large_allocation_until_neighbours_freed():
    alloc = FreeListAllocator(16 * 256, alignment=256)
    offsets = [alloc.allocate(256) for _ in range(16)]
    for off in offsets[::2]:
        alloc.free(off)
    assert alloc.free_bytes == 8 * 256
    assert alloc.largest_free == 256
    assert alloc.fragmentation == pytest.approx(1 - 1 / 8)
    assert alloc.allocate(512) is None
    alloc.free(offsets[5])  # joins blocks 4, 5, 6
    assert alloc.largest_free == 768
    assert alloc.allocate(512) == offsets[4]


def test_best_fit_keeps_large_block():
    alloc = FreeListAllocator(8 * 256, alignment=256)
    blocks = [alloc.allocate(256) for _ in range(8)]
    alloc.free(blocks[1])  # a 1-unit hole
    for off in blocks[4:]:
        alloc.free(off)  # a 4-unit hole at the end
    assert alloc.allocate(10) == blocks[1]
    assert alloc.allocate(1024) == blocks[4]


def test_double_free_and_bad_arguments_raise():
    alloc = FreeListAllocator(1024)
    off = alloc.allocate(10)
    alloc.free(off)
    with pytest.raises(InvalidInputError):
        alloc.free(off)
    with pytest.raises(InvalidInputError):
        alloc.free(12345)
    with pytest.raises(InvalidInputError):
        alloc.allocate(-1)
    with pytest.raises(InvalidInputError):
        FreeListAllocator(1024, alignment=3)
    with pytest.raises(InvalidInputError):
        FreeListAllocator(-1)


def _check_against_model(alloc, live, capacity, alignment):
    """No overlap, inside capacity, aligned, and byte counts agree with the model."""
    spans = sorted((off, alloc.size_of(off)) for off in live)
    for (off, size), nbytes in zip(spans, (live[o] for o, _ in spans)):
        assert off % alignment == 0 and size % alignment == 0
        assert size >= max(nbytes, 1) and off + size <= capacity
    for (a, sa), (b, _) in zip(spans, spans[1:]):
        assert a + sa <= b, "live blocks overlap"
    used = sum(size for _, size in spans)
    assert alloc.used_bytes == used and alloc.free_bytes == capacity - used
    assert alloc.num_allocations == len(live)
    assert alloc.largest_free <= alloc.free_bytes


def test_random_stress_against_model():
    rng = random.Random(1234)
    capacity, alignment = 64 * 1024, 64
    alloc = FreeListAllocator(capacity, alignment)
    live: dict[int, int] = {}
    for step in range(3000):
        if live and (rng.random() < 0.45 or alloc.free_bytes < 1024):
            off = rng.choice(list(live))
            alloc.free(off)
            del live[off]
        else:
            nbytes = rng.choice([0, 1, 63, 64, 65, rng.randrange(1, 4096)])
            off = alloc.allocate(nbytes)
            if off is None:
                assert alloc.largest_free < alloc.block_size(nbytes)
                continue
            assert off not in live
            live[off] = nbytes
        if step % 50 == 0:
            _check_against_model(alloc, live, capacity, alignment)
    for off in list(live):
        alloc.free(off)
    assert alloc.used_bytes == 0 and alloc.num_free_blocks == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000), st.integers(0, 10**6)),
                max_size=80))
def test_hypothesis_ops_keep_invariants(ops):
    capacity, alignment = 16 * 1024, 256
    alloc = FreeListAllocator(capacity, alignment)
    live: dict[int, int] = {}
    for is_free, nbytes, pick in ops:
        if is_free and live:
            off = sorted(live)[pick % len(live)]
            alloc.free(off)
            del live[off]
        else:
            off = alloc.allocate(nbytes)
            if off is not None:
                live[off] = nbytes
        _check_against_model(alloc, live, capacity, alignment)
    for off in list(live):
        alloc.free(off)
    assert alloc.largest_free == capacity
