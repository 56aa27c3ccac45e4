"""One micro-batch's host widen shared among threads: its plan cut into shares of about as many rows each.

A stream restores each micro-batch on its restore thread, and on the host
that restore is the widen: a codec call per field that reads the compact
bytes and writes four bytes an ID, outside the GIL. One thread's widen is
then the stream's pace, while the trainer's other cores idle. The rows of
a widen plan write disjoint output rows, so any cut of the plan restores
the same bytes: :func:`plan_shares` cuts it into
``GputqConfig.restore_threads`` shares, and :class:`WidenShares` widens
them at once over :func:`~gputq.client.fanout.fan_out`, whose caller (the
restoring thread) takes the first share, and any no idle thread took.

A share costs a hand-off to another thread, and a thread woken from idle
more, which a small widen does not repay: a field is shared only where each
share restores at least :data:`MIN_SHARE_BYTES`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from gputq.client.fanout import fan_out

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
    """Run a large widen in ``parts`` shares at once, on the calling thread and the process's fan-out threads
    (:func:`~gputq.client.fanout.fan_out`: the caller runs the first share, and any share no thread has
    taken by then; it returns once every share is done)."""

    def __init__(self, parts: int):
        self._parts = parts

    def __call__(self, widen: Callable[[np.ndarray], object], plan: np.ndarray, row_bytes: int) -> None:
        """Run ``widen(share)`` over shares of ``plan`` whose rows restore ``row_bytes`` each; returns once
        every share is done, raising the first share's error (no share still writes then)."""
        rows = int(np.asarray(plan)[:, 2].sum()) if len(plan) else 0
        parts = min(self._parts, rows * row_bytes // MIN_SHARE_BYTES)
        if parts < 2:
            widen(plan)
            return
        shares = plan_shares(plan, parts)
        done = fan_out(range(len(shares)), lambda i: widen(shares[i]))  # raises what is not a GputqError
        failed = next((r for r in done.values() if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
