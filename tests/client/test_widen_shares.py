"""A micro-batch's host widen in shares: the plan's cuts, the same bytes, at once, errors after every share."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gputq.client import widen_shares
from gputq.client.widen_shares import MIN_SHARE_BYTES, WidenShares, plan_shares
from gputq.errors import PlanError
from gputq.kernels import restore_scatter

pytestmark = pytest.mark.timeout(60)

PLAN = np.array([[0, 0, 5], [-1, 5, 2], [10, 7, 3]], dtype=np.int64)  # 10 rows: 5 copied, 2 filled, 3 copied


def _row_map(plan: np.ndarray) -> list[tuple[int, int]]:
    """Each target row with its source row (-1: filled), in plan order."""
    return [(-1 if src < 0 else src + i, dst + i) for src, dst, rows in plan.tolist() for i in range(rows)]


def test_a_plan_is_cut_into_shares_of_about_as_many_rows_a_row_cut_where_a_share_ends():
    assert [share.tolist() for share in plan_shares(PLAN, 2)] == [[[0, 0, 5]], [[-1, 5, 2], [10, 7, 3]]]
    # Rows [0, 3), [3, 6), [6, 10): the first and the fill row each cut in two, a fill row's source stays -1.
    assert [share.tolist() for share in plan_shares(PLAN, 3)] == [
        [[0, 0, 3]], [[3, 3, 2], [-1, 5, 1]], [[-1, 6, 1], [10, 7, 3]]]


def test_shares_are_never_empty_and_never_more_than_the_rows():
    assert [share.tolist() for share in plan_shares(np.array([[4, 0, 2]]), 5)] == [[[4, 0, 1]], [[5, 1, 1]]]
    assert [share.tolist() for share in plan_shares(PLAN, 1)] == [PLAN.tolist()]
    assert [share.tolist() for share in plan_shares(np.zeros((0, 3), np.int64), 4)] == [[]]


@pytest.mark.parametrize("seed", range(20))
def test_shares_together_restore_every_row_of_the_plan_once_in_order(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    rows = rng.integers(0, 9, n)  # rows of 0 too: they restore nothing
    dst = np.concatenate([[0], np.cumsum(rows)[:-1]])
    src = np.where(rng.random(n) < 0.3, -1, rng.integers(0, 100, n))
    plan = np.stack([src, dst, rows], axis=1).astype(np.int64)
    for parts in range(1, 8):
        shares = plan_shares(plan, parts)
        assert len(shares) == max(1, min(parts, int(rows.sum())))
        assert all(share[:, 2].sum() > 0 for share in shares) or rows.sum() == 0
        sizes = [int(share[:, 2].sum()) for share in shares]
        assert max(sizes) - min(sizes) <= 1
        assert sum((_row_map(share) for share in shares), []) == _row_map(plan)


def _large(rows_per_share: int = 3):
    """A uint16 compact field whose restore is ``2 * rows_per_share`` shares' worth of int32 rows, and its plan."""
    width = 64
    rows = -(-2 * rows_per_share * (MIN_SHARE_BYTES // (width * 4)) // 100) * 100  # whole pieces of 100 rows
    rng = np.random.default_rng(1)
    compact = rng.integers(0, 1 << 16, rows * width, dtype=np.uint16)
    # Rows reversed in pieces, and a fill piece: a plan whose rows are not one run.
    pieces = [[rows - 100 - i * 100, i * 100, 100] for i in range(rows // 100 - 1)] + [[-1, rows - 100, 100]]
    return compact, np.array(pieces, dtype=np.int64), width, rows


def _widen_into(compact, width, out, threads: list):
    def widen(share):
        threads.append((threading.current_thread().name, share[0].tolist()))
        restore_scatter(compact, share, width, out, 7, validate=False)
    return widen


def test_a_large_widen_in_shares_restores_the_same_bytes():
    compact, plan, width, rows = _large()
    want = np.zeros(rows * width, np.int32)
    restore_scatter(compact, plan, width, want, 7)
    for parts, shared in ((2, 2), (3, 3), (9, 6)):  # at most one share a MIN_SHARE_BYTES restored
        out, threads = np.zeros(rows * width, np.int32), []
        WidenShares(parts)(_widen_into(compact, width, out, threads), plan, width * 4)
        assert np.array_equal(out, want)
        assert len(threads) == shared
        first = plan[0].tolist()
        assert [name for name, head in threads if head == first] == ["MainThread"]  # the first, the caller's


def test_the_shares_run_at_once():
    """The caller's share waits until another share started: run one after another, it would wait in vain."""
    compact, plan, width, rows = _large()
    started, threads = threading.Event(), []

    def widen(share):
        threads.append(threading.current_thread().name)
        if share[0].tolist() == plan[0].tolist():
            assert started.wait(10), "the other share did not start while the caller's ran"
        else:
            started.set()

    WidenShares(2)(widen, plan, width * 4)
    assert threads.count("MainThread") == 1 and len(threads) == 2


def test_a_small_widen_or_one_part_widens_whole_on_the_calling_thread():
    compact, plan, width, rows = _large(rows_per_share=1)
    # At width * 2 bytes a row, two shares would each restore less than MIN_SHARE_BYTES.
    for shares, row_bytes in ((WidenShares(2), width * 2), (WidenShares(1), width * 4)):
        out, threads = np.zeros(rows * width, np.int32), []
        shares(_widen_into(compact, width, out, threads), plan, row_bytes)
        assert threads == [("MainThread", plan[0].tolist())]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_share_raises_once_every_share_is_done(failing):
    """No share still writes into the outputs once the widen raised (the stream then reuses them)."""
    compact, plan, width, rows = _large()
    out, done, gate = np.zeros(rows * width, np.int32), [], threading.Event()

    def widen(share):
        index = 0 if share[0].tolist() == plan[0].tolist() else 1
        if index == 0:
            gate.wait(10)  # the helper's share raises first, or starts, while the caller's waits here
        else:
            gate.set()
        if index == failing:
            raise PlanError(f"share {index}")
        restore_scatter(compact, share, width, out, 7)  # work a caller not waiting for it would not see done
        done.append(index)

    with pytest.raises(PlanError, match=f"share {failing}"):
        WidenShares(2)(widen, plan, width * 4)
    assert done == [1 - failing]


def test_the_share_size_is_read_where_the_widen_runs(monkeypatch):
    """The stream tests shrink it to share their small micro-batches: it must be read at each call."""
    compact, plan, width, rows = _large(rows_per_share=1)
    monkeypatch.setattr(widen_shares, "MIN_SHARE_BYTES", 1024)
    out, threads = np.zeros(rows * width, np.int32), []
    WidenShares(2)(_widen_into(compact, width, out, threads), plan, width * 2)
    assert len(threads) == 2
