"""The kernel's fragment table and block arithmetic, replayed on the host (no GPU needed).

:func:`replay` walks the grid exactly as ``widen_scatter.cu`` does (binary
search for the block's fragment, head, chunk, grouped part, tail) and
counts how often each output element is written. Every covered element
must be written once, with the reference's value; nothing else touched.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from gputq.errors import PlanError
from gputq.kernels import reference_widen_scatter
from gputq.kernels.cupy_backend import DEFAULT_STEPS, chunk_elements, fragment_table
from gputq.kernels.plan import validate_plan
from tests.kernels.test_reference import DTYPES, bits, poisoned_out, random_plan, random_staging


def replay(staging, plan, width, out, fill, *, steps=DEFAULT_STEPS, dst_shift=0):
    """Do what the kernel's grid does, block by block; return per-element write counts.

    ``dst_shift`` places ``out`` that many elements past a 16-byte boundary,
    which moves every fragment's head.
    """
    itemsize = staging.dtype.itemsize
    vec = 16 // itemsize
    chunk = chunk_elements(itemsize, steps)
    table, nblocks = fragment_table(plan, width, chunk)
    n = len(plan)
    frags, first = table[:3 * n].reshape(n, 3), table[3 * n:]
    writes = np.zeros(out.size, np.int64)
    src = staging.reshape(-1)
    for b in range(nblocks):
        lo = int(np.searchsorted(first, b, side="right")) - 1  # the last fragment with first <= b
        s, d, count = (int(v) for v in frags[lo])
        head = min(count, ((16 - ((dst_shift + d) * 4) % 16) % 16) // 4)
        begin = head + (b - int(first[lo])) * chunk
        length = max(0, min(count - begin, chunk))
        groups = length // vec
        spans = [(begin, begin + groups * vec), (begin + groups * vec, begin + length)]
        if b == first[lo]:
            spans.append((0, head))
        for start, stop in spans:
            out[d + start:d + stop] = fill if s < 0 else src[s + start:s + stop]
            writes[d + start:d + stop] += 1
    return writes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,steps,dst_shift", [(1, 4, 0), (3, 1, 1), (384, 4, 2), (7, 2, 3)])
def test_replayed_grid_writes_each_covered_element_once(dtype, width, steps, dst_shift):
    rng = np.random.default_rng(width * 31 + steps)
    src_rows, dst_rows = 3000 // width + 40, 6000 // width + 80
    staging = random_staging(rng, dtype, src_rows * width)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=2000 // width + 3)
    plan = np.concatenate([plan, [[0, 0, 0], [-1, dst_rows - 1, 0]]])  # empty rows get no block
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 5)
    out = poisoned_out(dtype, dst_rows * width)
    writes = replay(staging, plan, width, out, 5, steps=steps, dst_shift=dst_shift)
    covered = np.zeros(dst_rows * width, bool)
    for _, d, r in plan.tolist():
        covered[d * width:(d + r) * width] = True
    assert (writes[covered] == 1).all() and (writes[~covered] == 0).all()
    np.testing.assert_array_equal(bits(out), bits(want))


def test_table_layout_and_empty_plans():
    plan = np.array([[5, 0, 3], [-1, 3, 2], [0, 5, 0], [1, 5, 4]], np.int64)
    table, nblocks = fragment_table(plan, 10, 16)
    assert table[:12].reshape(4, 3).tolist() == [[50, 0, 30], [-10, 30, 20], [0, 50, 0], [10, 50, 40]]
    assert table[12:].tolist() == [0, 2, 4, 4] and nblocks == 7
    buf = np.full(64, -7, np.int64)
    built, n = fragment_table(plan, 10, 16, out=buf)
    assert built.base is buf or np.shares_memory(built, buf)
    assert n == 7 and (buf[16:] == -7).all()
    assert fragment_table(np.zeros((0, 3), np.int64), 10, 16)[1] == 0
    assert chunk_elements(1) == 4 * chunk_elements(4) == 2 * chunk_elements(2) == 16 * 4 * 256


def test_fast_validation_agrees_with_the_row_checks():
    rng = np.random.default_rng(9)
    for _ in range(300):
        src_rows, dst_rows = int(rng.integers(1, 60)), int(rng.integers(1, 60))
        plan = np.stack([rng.integers(-2, src_rows + 2, 6), rng.integers(-1, dst_rows + 2, 6),
                         rng.integers(-1, 12, 6)], axis=1)
        rows = plan.tolist()
        slow_ok = all(r >= 0 and s >= -1 and d >= 0 and not (s >= 0 and s + r > src_rows)
                      and d + r <= dst_rows for s, d, r in rows)
        live = [(d, r) for _, d, r in rows if r > 0]
        slow_ok = slow_ok and not any(d1 < d2 + r2 and d2 < d1 + r1
                                      for i, (d1, r1) in enumerate(live) for d2, r2 in live[i + 1:])
        if slow_ok:
            assert validate_plan(plan, src_rows, dst_rows) is not None
        else:
            with pytest.raises(PlanError):
                validate_plan(plan, src_rows, dst_rows)


@pytest.mark.timeout(60)
def test_host_side_of_a_launch_is_cheap_for_a_thousand_fragments():
    """Validation plus the table of 1,000 fragments: well under a millisecond, even here."""
    from bench.kernel import host_side_us, make_shard_plan

    plan, src_rows = make_shard_plan(np.random.default_rng(0), 2**21, 128)
    assert 900 <= len(plan) <= 1200
    start = time.perf_counter()
    us = host_side_us(plan, src_rows, 384, "uint8", repeats=50)
    assert 0 < us < 1000 and time.perf_counter() - start < 30
