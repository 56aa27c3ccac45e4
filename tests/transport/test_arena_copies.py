"""Copies out of a mapped arena: runs, pieces shared with threads that come free, and their errors."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from gputq.transport import arena_copies
from gputq.transport.arena_copies import copy_runs, help_copies, merge_runs
from tests.transport.piecewise import NumpyWithCopyto, share_every_copy
from tests.waiting import wait_until


def test_merge_runs_joins_regions_adjacent_in_the_arena():
    regions = np.array([[0, 10], [10, 5], [100, 3], [103, 0], [103, 7], [50, 0]], np.int64)
    offsets, packed, lengths = merge_runs(regions)
    assert offsets.tolist() == [0, 100]
    assert packed.tolist() == [0, 15]
    assert lengths.tolist() == [15, 10]
    empty = merge_runs(np.zeros((0, 2), np.int64))
    assert all(len(a) == 0 for a in empty)


@pytest.fixture
def in_pieces(monkeypatch):
    """No pool threads, every copy shared, pieces of 1000 bytes; a source and its runs (9 pieces)."""
    share_every_copy(monkeypatch, 1000)
    src = np.random.default_rng(4).integers(0, 256, 10_000, dtype=np.uint8)
    runs = [(0, 0, 6000), (7000, 6000, 3000)]
    return src, runs, np.concatenate([src[:6000], src[7000:]])


def _helping_thread() -> threading.Thread:
    """A thread that comes free while a copy is under way and helps it."""
    def come_free():
        wait_until(lambda: arena_copies._under_way, 10, "a copy under way")
        help_copies()

    thread = threading.Thread(target=come_free, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_a_thread_come_free_takes_pieces_and_the_copy_returns_after_them(in_pieces, monkeypatch):
    src, runs, want = in_pieces
    owner, pieces = threading.get_ident(), Counter()
    helper_copied, helper_done = threading.Event(), threading.Event()

    def copyto(dst, piece):
        me = threading.get_ident()
        pieces[me] += 1
        if me == owner and pieces[me] == 1 and not helper_copied.wait(10):
            raise AssertionError("no thread come free took a piece")
        np.copyto(dst, piece)
        if me != owner:
            helper_copied.set()
            # Still copying when the caller has taken every other piece: it must wait for this one.
            wait_until(lambda: not arena_copies._under_way, 10, "the caller to run out of pieces")
            helper_done.set()

    monkeypatch.setattr(arena_copies, "np", NumpyWithCopyto(copyto))
    helper = _helping_thread()
    out = np.zeros(want.size, np.uint8)
    copy_runs(out, src, runs)
    assert helper_done.is_set()  # copy_runs returned only once the helper's piece was in
    assert np.array_equal(out, want)
    assert sorted(pieces.values()) == [1, 8] and pieces[owner] == 8
    helper.join(10)


@pytest.mark.timeout(30)
def test_an_error_in_a_piece_another_thread_copies_reaches_the_caller(in_pieces, monkeypatch):
    src, runs, want = in_pieces
    owner, failed = threading.get_ident(), threading.Event()

    def copyto(dst, piece):
        if threading.get_ident() != owner:
            failed.set()
            raise ValueError("a piece could not be copied")
        if not failed.wait(10):
            raise AssertionError("no thread come free took a piece")
        np.copyto(dst, piece)

    monkeypatch.setattr(arena_copies, "np", NumpyWithCopyto(copyto))
    helper = _helping_thread()
    with pytest.raises(ValueError, match="could not be copied"):
        copy_runs(np.zeros(want.size, np.uint8), src, runs)
    assert not arena_copies._under_way
    helper.join(10)


def test_small_copies_stay_in_the_caller(monkeypatch):
    # Below PARALLEL_COPY_BYTES there is nothing to share: no thread can join.
    seen = []
    monkeypatch.setattr(arena_copies, "np", NumpyWithCopyto(lambda dst, piece: (seen.append(arena_copies._under_way.copy()),
                                                                     np.copyto(dst, piece))))
    src = np.arange(256, dtype=np.uint8)
    out = np.zeros(100, np.uint8)
    copy_runs(out, src, [(10, 0, 60), (200, 60, 40)])
    assert np.array_equal(out, np.concatenate([src[10:70], src[200:240]]))
    assert seen == [set(), set()]


@pytest.mark.timeout(30)
def test_pool_threads_share_a_large_copy(monkeypatch):
    share_every_copy(monkeypatch, 4096, threads=3)
    src = np.random.default_rng(6).integers(0, 256, 1 << 20, dtype=np.uint8)
    runs = [(0, 300_000, 500_000), (600_000, 0, 300_000)]
    out = np.zeros(800_000, np.uint8)
    copy_runs(out, src, runs)
    assert np.array_equal(out, np.concatenate([src[600_000:900_000], src[:500_000]]))
    assert not arena_copies._under_way
