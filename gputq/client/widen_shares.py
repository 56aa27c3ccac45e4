"""One micro-batch's host widen shared among threads: its plan cut into shares of about as many rows each.

A stream restores each micro-batch on its restore thread, and on the host
that restore is the widen: a codec call per field that reads the compact
bytes and writes four bytes an ID, outside the GIL. One thread's widen is
then the stream's pace, while the trainer's other cores idle. The rows of
a widen plan write disjoint output rows, so any cut of the plan restores
the same bytes: :func:`plan_shares` cuts it, and :class:`WidenShares`
runs the first share on the calling thread and the others on helper
threads (``GputqConfig.restore_threads``), then waits for them all.

A share costs a hand-off to a helper, and a helper woken from idle more,
which a small widen does not repay: a field is shared only where each
share restores at least :data:`MIN_SHARE_BYTES`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

__all__ = ["WidenShares", "plan_shares", "MIN_SHARE_BYTES"]

#: Restored bytes each share of a shared widen writes at least. Measured over shm on two cores: micro-batches
#: of 6 MiB restored were no faster in two shares, of 12 MiB and more were (docs/PERFORMANCE.md).
MIN_SHARE_BYTES = 4 << 20


def plan_shares(plan: np.ndarray, parts: int) -> list[np.ndarray]:
    """``plan`` (``[n, 3]``: source row or -1 for fill, target row, rows) cut into ``parts`` plans of about
    as many rows each, in order; a plan row cut in two where a share ends. Fewer where it has fewer rows;
    none of them empty."""
    plan = np.asarray(plan, dtype=np.int64).reshape(-1, 3)
    ends = np.cumsum(plan[:, 2])
    total = int(ends[-1]) if len(plan) else 0
    parts = max(1, min(int(parts), total))
    if parts == 1:
        return [plan]
    firsts = ends - plan[:, 2]
    shares = []
    for k in range(parts):
        low, high = total * k // parts, total * (k + 1) // parts
        # Plan rows ``[i, j)`` hold rows ``[low, high)`` of the whole, the first and last cut to them.
        i, j = int(np.searchsorted(ends, low, side="right")), int(np.searchsorted(firsts, high, side="left"))
        share = plan[i:j].copy()
        head, tail = low - int(firsts[i]), int(ends[j - 1]) - high
        share[0, 0] += head if share[0, 0] >= 0 else 0
        share[0, 1] += head
        share[0, 2] -= head
        share[-1, 2] -= tail
        shares.append(share)
    return shares


class WidenShares:
    """Run a widen's shares: the first on the calling thread, the others on ``helpers``.

    Parameters
    ----------
    helpers:
        The threads that take the shares after the first, ``parts - 1`` of them;
        None: every widen runs whole on the calling thread.
    parts:
        Shares a large widen is cut into: the calling thread's and the helpers'.
    """

    def __init__(self, helpers: ThreadPoolExecutor | None, parts: int):
        self._helpers = helpers
        self._parts = parts if helpers is not None else 1

    def __call__(self, widen: Callable[[np.ndarray], object], plan: np.ndarray, row_bytes: int) -> None:
        """Run ``widen(share)`` over shares of ``plan`` whose rows restore ``row_bytes`` each; returns once
        every share is done, raising the first share's error (the others were waited for)."""
        rows = int(np.asarray(plan)[:, 2].sum()) if len(plan) else 0
        parts = min(self._parts, rows * row_bytes // MIN_SHARE_BYTES)
        if parts < 2:
            widen(plan)
            return
        first, *others = plan_shares(plan, parts)
        helped = [self._hand(widen, share) for share in others]
        try:
            widen(first)
        finally:
            failed = [f.exception() for f in helped]  # waits: no share writes once this returns
        raised = next((exc for exc in failed if exc is not None), None)
        if raised is not None:
            raise raised

    def _hand(self, widen: Callable, share: np.ndarray) -> Future:
        """``widen(share)`` on a helper; here and now where the helpers are shut down (the reader closing)."""
        try:
            return self._helpers.submit(widen, share)
        except RuntimeError:
            done: Future = Future()
            try:
                done.set_result(widen(share))
            except BaseException as exc:  # raised by the caller, once the others are waited for
                done.set_exception(exc)
            return done
