"""The numpy reference, plan validation and the torch fallback, checked on
the host against a naive per-row oracle."""

from __future__ import annotations

import numpy as np
import pytest

from gputq import kernels
from gputq.errors import PlanError
from gputq.kernels import plan_bytes, reference_widen_scatter, validate_plan, widen_scatter

DTYPES = ["uint8", "uint16", "int32", "float32"]
WIDTHS = [1, 3, 7, 8, 600]
POISON_INT = -123456789  # no uint8/uint16 value widens to it
POISON_BITS = 0x7FC0DEAD  # a NaN payload the random floats never take


def out_dtype(in_dtype: str) -> np.dtype:
    return np.dtype(np.float32 if in_dtype == "float32" else np.int32)


def random_staging(rng, dtype: str, n: int) -> np.ndarray:
    """Random compact elements; floats include -0.0, inf and a NaN payload."""
    if dtype == "float32":
        x = rng.standard_normal(n).astype(np.float32)
        specials = np.array([-0.0, np.inf, -np.inf], np.float32)
        specials = np.concatenate([specials, np.array([0x7FC00001], np.int32).view(np.float32)])
        x[rng.integers(0, n, size=min(n, 4))] = specials[: min(n, 4)]
        return x
    hi = {"uint8": 2**8, "uint16": 2**16, "int32": 2**31}[dtype]
    return rng.integers(0, hi, size=n).astype(dtype)


def poisoned_out(dtype: str, n: int) -> np.ndarray:
    out = np.empty(n, out_dtype(dtype))
    out.view(np.int32)[:] = POISON_BITS if dtype == "float32" else POISON_INT
    return out


def random_plan(rng, src_rows: int, dst_rows: int, max_frag: int = 50) -> np.ndarray:
    """Ragged fragments tiling part of [0, dst_rows): copies, fills and gaps, shuffled."""
    rows = []
    pos = 0
    while pos < dst_rows:
        n = int(rng.integers(1, max_frag + 1))
        n = min(n, dst_rows - pos)
        kind = rng.random()
        if kind < 0.15:
            pass  # a gap: rows left untouched
        elif kind < 0.3 or src_rows < n:
            rows.append((-1, pos, n))
        else:
            rows.append((int(rng.integers(0, src_rows - n + 1)), pos, n))
        pos += n
    plan = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return plan[rng.permutation(len(plan))]


def naive_widen_scatter(staging, plan, width, out, fill):
    """The oracle: one element at a time, straight from the definition."""
    for src, dst, rows in plan.tolist():
        for r in range(rows):
            for c in range(width):
                o = (dst + r) * width + c
                out[o] = fill if src == -1 else staging[(src + r) * width + c]
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32)


# --- the reference --------------------------------------------------------------


@pytest.mark.parametrize("max_frag", [9, 120], ids=["gather-path", "slice-path"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_reference_matches_naive_oracle(dtype, width, max_frag):
    rng = np.random.default_rng(1000 * DTYPES.index(dtype) + width + max_frag)
    src_rows, dst_rows = int(rng.integers(1, 60)), int(rng.integers(1, 120))
    if max_frag > 9:  # fragments long enough for slice copies
        src_rows, dst_rows = int(rng.integers(150, 300)), int(rng.integers(200, 400))
    if width == 600:
        src_rows, dst_rows = (7, 11) if max_frag == 9 else (130, 140)
    staging = random_staging(rng, dtype, src_rows * width)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=max_frag)
    fill = -7 if dtype != "float32" else 2.5
    got = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), fill)
    want = naive_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), fill)
    assert got.dtype == out_dtype(dtype)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("seed", range(20))
def test_reference_random_shapes(seed):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[seed % 4]
    width = int(rng.integers(1, 20))
    src_rows, dst_rows = int(rng.integers(0, 40)), int(rng.integers(1, 80))
    staging = random_staging(rng, dtype, src_rows * width) if src_rows else np.zeros(0, dtype)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=12)
    got = widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), fill=3)
    want = naive_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), 3)
    np.testing.assert_array_equal(bits(got), bits(want))


def layered_plan(rng, layers: int, tokens: int, fragments: int, src_step: int) -> np.ndarray:
    """A stream's plan: fragments (one a fill) in every layer of a layer-major output, fragment-major."""
    rows, cursor = [], 0
    sizes = rng.integers(20, tokens // fragments, size=fragments)
    for f, n in enumerate(sizes.tolist()):
        for layer in range(layers):
            src = -1 if f == 1 else f * layers * src_step + layer * src_step
            rows.append((src, layer * tokens + cursor, n))
        cursor += n
    return np.array(rows, np.int64)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_runs_of_plan_rows_at_constant_steps_are_copied_as_blocks_bit_for_bit(dtype):
    rng = np.random.default_rng(3)
    layers, tokens, width, step = 6, 400, 8, 130
    plan = layered_plan(rng, layers, tokens, 4, step)
    assert len(kernels.reference._strided_runs(plan.tolist())) == 4  # one block per fragment, not per layer
    staging = random_staging(rng, dtype, 4 * layers * step * width)
    out = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, layers * tokens * width), 5)
    want = naive_widen_scatter(staging, plan, width, poisoned_out(dtype, layers * tokens * width), 5)
    assert np.array_equal(bits(out), bits(want))


def test_rows_of_one_length_at_uneven_steps_are_copied_where_each_says():
    rng = np.random.default_rng(4)
    n, rows, width = 12, 32, 3
    even = np.arange(n, dtype=np.int64)
    uneven = np.sort(rng.choice(4 * n, size=n, replace=False)).astype(np.int64)
    for src, dst in ((rng.permutation(n) * rows, even * 40), (even * rows, uneven * rows)):  # one side even
        plan = np.stack([src, dst, np.full(n, rows)], axis=1)
        staging = random_staging(rng, "uint16", n * rows * width)
        size = (int(dst.max()) + rows) * width
        out = reference_widen_scatter(staging, plan, width, poisoned_out("uint16", size))
        want = naive_widen_scatter(staging, plan, width, poisoned_out("uint16", size), 0)
        assert np.array_equal(bits(out), bits(want))


def test_an_unvalidated_run_past_the_buffers_is_clipped_as_its_rows_would_be():
    # The last row runs 10 rows past both buffers: a strided block would write past out's end.
    plan = np.array([(0, 0, 40), (40, 50, 40), (80, 100, 40), (120, 150, 40)], np.int64)
    staging = np.arange(150 * 2, dtype=np.uint16)
    beyond = np.full(200 * 2, -1, np.int32)  # out is its first 180 rows: nothing may land past them
    out = reference_widen_scatter(staging, plan, 2, beyond[:180 * 2], validate=False)
    assert np.all(beyond[180 * 2:] == -1)
    want = np.full(180 * 2, -1, np.int32).reshape(-1, 2)
    rows = staging.reshape(-1, 2)
    for src, dst, n in plan.tolist():  # numpy slices: each row range clipped to both buffers
        part = rows[src:src + n]
        want[dst:dst + len(part)] = part
    assert np.array_equal(out, want.reshape(-1))


def test_uncovered_rows_untouched_and_covered_rows_written():
    staging = np.arange(1, 13, dtype=np.uint8)  # 4 rows of 3, no zeros
    out = np.full(6 * 3, POISON_INT, np.int32)
    plan = np.array([[2, 4, 2], [-1, 0, 1], [0, 2, 1]])
    widen_scatter(staging, plan, 3, out, fill=0)
    np.testing.assert_array_equal(
        out.reshape(6, 3),
        [[0, 0, 0], [POISON_INT] * 3, [1, 2, 3], [POISON_INT] * 3, [7, 8, 9], [10, 11, 12]],
    )


def test_widening_keeps_high_unsigned_values():
    staging = np.array([255, 0, 128], np.uint8)
    out = widen_scatter(staging, [[0, 0, 3]], 1, np.zeros(3, np.int32))
    assert out.tolist() == [255, 0, 128]
    staging16 = np.array([65535, 32768, 1], np.uint16)
    out = widen_scatter(staging16, [[0, 0, 3]], 1, np.zeros(3, np.int32))
    assert out.tolist() == [65535, 32768, 1]


def test_empty_plan_and_zero_row_entries_write_nothing():
    out = poisoned_out("uint8", 12)
    staging = np.arange(12, dtype=np.uint8)
    for plan in (np.zeros((0, 3), np.int64), [], [[0, 1, 0], [-1, 2, 0]]):
        widen_scatter(staging, plan, 4, out)
        assert (out == POISON_INT).all()


def test_one_row_plan():
    staging = np.array([1.5, -2.0], np.float32)
    out = np.zeros(6, np.float32)
    widen_scatter(staging, np.array([[0, 2, 1]]), 2, out)
    assert out.tolist() == [0, 0, 0, 0, 1.5, -2.0]


def test_returns_out_and_accepts_shaped_staging():
    staging = np.arange(6, dtype=np.uint16).reshape(3, 2)
    out = np.zeros((2, 2), np.int32)
    assert widen_scatter(staging, [[1, 0, 2]], 2, out) is out
    assert out.tolist() == [[2, 3], [4, 5]]


def test_validate_false_skips_plan_checks_only():
    staging = np.arange(4, dtype=np.uint8)
    out = np.zeros(4, np.int32)
    # Overlapping destinations are the caller's business without validation.
    widen_scatter(staging, [[0, 0, 2], [2, 1, 2]], 1, out, validate=False)
    assert out.tolist() == [0, 2, 3, 0]
    with pytest.raises(PlanError, match="widens into int32"):
        widen_scatter(staging, [[0, 0, 2]], 1, np.zeros(4, np.float32), validate=False)


def test_plan_bytes_counts_reads_and_writes():
    plan = np.array([[0, 0, 3], [-1, 3, 2], [5, 5, 0]])
    assert plan_bytes(np.uint8, np.int32, plan, 10) == 3 * 10 * 5 + 2 * 10 * 4
    assert plan_bytes("float32", "float32", plan, 1) == 3 * 8 + 2 * 4
    assert plan_bytes(np.uint16, np.int32, [], 7) == 0


# --- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    "plan, message",
    [
        ([[0, 0, 2], [5, 2, 2]], r"plan row 1 \(src_row=5, dst_row=2, rows=2\) reads past"),
        ([[0, 9, 2]], r"plan row 0 .* writes past the output buffer \(10 rows\)"),
        ([[-1, 9, 2]], r"plan row 0 .* writes past"),
        ([[0, 0, 3], [1, 2, 2]], r"plan row 1 .* overlaps the destination rows of plan row 0"),
        ([[0, 5, 1], [0, 0, 2], [2, 4, 2]], r"plan row 0 .* overlaps .* plan row 2"),
        ([[0, 0, -1]], r"plan row 0 .* negative rows"),
        ([[0, -1, 1]], r"negative dst_row"),
        ([[-2, 0, 1]], r"src_row below -1"),
        ([[0, 0]], r"shape \[n, 3\]"),
        ([[[0, 0, 1]]], r"shape \[n, 3\]"),
        ([[0.0, 0.0, 1.0]], r"integers"),
    ],
)
def test_invalid_plans_raise_plan_error(plan, message):
    with pytest.raises(PlanError, match=message):
        validate_plan(plan, src_rows=6, dst_rows=10)
    with pytest.raises(PlanError, match=message):
        widen_scatter(np.zeros(12, np.uint8), plan, 2, np.zeros(20, np.int32))


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


@pytest.mark.parametrize(
    "staging, out, width, fill, message",
    [
        (np.zeros(4, np.uint8), np.zeros(4, np.float32), 1, 0, "widens into int32"),
        (np.zeros(4, np.float32), np.zeros(4, np.int32), 1, 0, "widens into float32"),
        (np.zeros(4, np.int64), np.zeros(4, np.int32), 1, 0, "not one of"),
        (np.zeros(4, np.uint8), np.zeros(4, np.int64), 1, 0, "widens into int32"),
        (np.zeros(4, np.uint8), np.zeros(5, np.int32), 2, 0, "out holds 5 elements"),
        (np.zeros(5, np.uint8), np.zeros(4, np.int32), 2, 0, "staging holds 5 elements"),
        (np.zeros(4, np.uint8), np.zeros(4, np.int32), 0, 0, "width must be"),
        (np.zeros(4, np.uint8), np.zeros(4, np.int32), 1, 2**31, "not representable"),
        (np.zeros(4, np.uint8), np.zeros(4, np.int32), 1, 0.5, "not representable"),
        (np.zeros(4, np.uint8), np.zeros(8, np.int32)[::2], 1, 0, "C-contiguous"),
    ],
)
def test_bad_buffers_raise_plan_error(staging, out, width, fill, message):
    with pytest.raises(PlanError, match=message):
        widen_scatter(staging, [[0, 0, 1]], width, out, fill)


def test_too_small_out_names_the_plan_row():
    with pytest.raises(PlanError, match=r"plan row 0 .* writes past the output buffer \(3 rows\)"):
        widen_scatter(np.zeros(8, np.uint8), [[0, 0, 4]], 2, np.zeros(6, np.int32))


def test_mixed_array_types_raise():
    torch = pytest.importorskip("torch")
    with pytest.raises(PlanError, match="same array type"):
        widen_scatter(np.zeros(2, np.uint8), [[0, 0, 1]], 1, torch.zeros(2, dtype=torch.int32))


def test_cuda_available_is_a_quiet_bool():
    assert isinstance(kernels.cuda_available(), bool)


# --- the torch fallback ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 7, 600])
def test_torch_fallback_on_cpu_matches_reference(dtype, width):
    torch = pytest.importorskip("torch")
    from gputq.kernels.torch_backend import torch_widen_scatter

    rng = np.random.default_rng(width * 10 + DTYPES.index(dtype))
    src_rows, dst_rows = (9, 13) if width == 600 else (50, 90)
    staging = random_staging(rng, dtype, src_rows * width)
    plan = random_plan(rng, src_rows, dst_rows, max_frag=8)
    fill = -3 if dtype != "float32" else float("nan")
    want = reference_widen_scatter(staging, plan, width, poisoned_out(dtype, dst_rows * width), fill)
    out = torch.from_numpy(poisoned_out(dtype, dst_rows * width))
    got = torch_widen_scatter(torch.from_numpy(staging), plan, width, out, fill)
    assert got is out
    np.testing.assert_array_equal(bits(got.numpy()), bits(want))
    # The dispatcher sends CPU tensors to the same fallback.
    out2 = torch.from_numpy(poisoned_out(dtype, dst_rows * width))
    widen_scatter(torch.from_numpy(staging), torch.from_numpy(plan), width, out2, fill)
    np.testing.assert_array_equal(bits(out2.numpy()), bits(want))


def test_torch_fallback_validates():
    torch = pytest.importorskip("torch")
    with pytest.raises(PlanError, match="overlaps"):
        widen_scatter(torch.zeros(4, dtype=torch.uint8), [[0, 0, 2], [0, 1, 1]], 1,
                      torch.zeros(4, dtype=torch.int32))
    with pytest.raises(PlanError, match="widens into int32"):
        widen_scatter(torch.zeros(4, dtype=torch.uint8), [[0, 0, 2]], 1,
                      torch.zeros(4, dtype=torch.float32))
