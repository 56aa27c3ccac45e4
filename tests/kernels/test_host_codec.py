"""The host codec of packed IDs (``host_codec.c``, built on first use) against the numpy reference, and its
fallback to numpy where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gputq.data.canonical import canonicalize
from gputq.data.fields import routed_experts_spec
from gputq.data.packing import pack_rows
from gputq.errors import FieldValueError, PlanError
from gputq.kernels import host_native
from gputq.kernels.host_native import host_codec, host_codec_status, narrow_rows_host, pack_rows_host, \
    unpack_rows_host, unpack_scatter_host, widen_scatter_host
from gputq.kernels.reference import reference_unpack_scatter
from tests.data.test_packing import _encode_bitwise
from tests.kernels.test_reference import naive_widen_scatter, random_plan

pytestmark = pytest.mark.timeout(120)


_PATHS = {"vbmi": host_native.PATH_BMI2 | host_native.PATH_VBMI | host_native.PATH_AVX512, "bmi2": host_native.PATH_BMI2, "bytewise": 0}


@pytest.fixture(params=sorted(_PATHS))
def codec(request):
    """The codec with the vector paths of ``request.param`` (where the CPU runs them), or an ID at a time."""
    lib = host_codec()
    if lib is None:
        pytest.skip(f"no host codec here: {host_codec_status()}")
    before = lib.gputq_set_paths(-1)
    if lib.gputq_set_paths(_PATHS[request.param]) != _PATHS[request.param]:
        lib.gputq_set_paths(before)
        pytest.skip(f"the CPU here does not run the {request.param} path")
    yield lib
    lib.gputq_set_paths(before)


@pytest.mark.parametrize("bits", range(1, 17))
def test_unpack_matches_the_reference_for_every_topk_and_tail(codec, bits):
    # 1 to 40 rows: the last rows of a buffer (fewer than 16 bytes left) take the byte-at-a-time loop.
    rng = np.random.default_rng(bits)
    for topk in range(1, 17):
        rows = int(rng.integers(1, 41))
        ids = rng.integers(0, 1 << bits, (rows, topk))
        packed = _encode_bitwise(ids, bits)
        got = np.full((rows, topk), -9, np.int32)
        unpack_rows_host(packed, topk, bits, got)
        np.testing.assert_array_equal(got, ids, err_msg=f"bits {bits} topk {topk}")
        plan = random_plan(rng, rows, rows + 9, max_frag=5)
        want = reference_unpack_scatter(packed.reshape(-1), plan, topk, bits, np.full((rows + 9) * topk, -7, np.int32),
                                        fill=3)
        got = unpack_scatter_host(packed.reshape(-1), plan, topk, bits, np.full((rows + 9) * topk, -7, np.int32),
                                  fill=3)
        np.testing.assert_array_equal(got, want, err_msg=f"bits {bits} topk {topk}")


@pytest.mark.parametrize("dtype,fill", [("uint8", 7), ("uint16", -1), ("int32", -5), ("float32", 0.5)])
def test_widen_scatter_matches_the_oracle_for_every_dtype(codec, dtype, fill):
    rng = np.random.default_rng(len(dtype))
    for width in (1, 3, 8, 17):
        for validate in (True, False):
            staging = rng.integers(0, 250, 90 * width).astype(dtype)
            plan = random_plan(rng, 90, 120, max_frag=12)
            out_dtype = np.float32 if dtype == "float32" else np.int32
            want = np.full(120 * width, 9, out_dtype)
            naive_widen_scatter(staging, plan, width, want, fill)
            got = widen_scatter_host(staging, plan, width, np.full(120 * width, 9, out_dtype), fill, validate=validate)
            np.testing.assert_array_equal(got, want, err_msg=f"width {width}")


def test_widen_scatter_refuses_a_plan_outside_the_buffers_even_unvalidated(codec):
    staging, out = np.zeros(10 * 4, np.uint16), np.full(10 * 4, 3, np.int32)
    for bad in ([[0, 8, 3]], [[8, 0, 3]], [[-1, 9, 2]], [[0, -1, 1]]):
        with pytest.raises(PlanError):
            widen_scatter_host(staging, [[0, 0, 1]] + bad, 4, out, validate=False)
    assert (out[4:] == 3).all()  # the plan row before the bad one was written, nothing after it


def test_unpack_into_strided_rows_writes_only_them(codec):
    ids = np.random.default_rng(3).integers(0, 384, (50, 8))
    target = np.full((50, 4, 8), -1, np.int32)
    unpack_rows_host(pack_rows(ids, 384), 8, 9, target[:, 2])  # rows 128 bytes apart
    np.testing.assert_array_equal(target[:, 2], ids)
    assert (target[:, [0, 1, 3]] == -1).all()


def test_unpack_scatter_refuses_what_the_reference_refuses(codec):
    staging = np.zeros(9 * 4, np.uint8)
    with pytest.raises(PlanError, match="plan row 0"):
        unpack_scatter_host(staging, [[3, 0, 2]], 8, 9, np.zeros(8 * 4, np.int32))
    with pytest.raises(PlanError, match="whole rows"):
        unpack_scatter_host(staging[:10], [[0, 0, 1]], 8, 9, np.zeros(8 * 4, np.int32))


@pytest.mark.parametrize("layer_major", [False, True])
@pytest.mark.parametrize("experts,topk", [(2, 1), (128, 8), (384, 8), (512, 10), (1000, 16), (65536, 20)])
def test_pack_writes_the_references_bytes_in_either_layout(codec, experts, topk, layer_major):
    ids = np.random.default_rng(experts).integers(0, experts, (300, 5, topk)).astype(np.int32)
    want = pack_rows(ids, experts)  # [300, 5, bytes], numpy
    out = np.full(want.shape, 0xEE, np.uint8)
    assert pack_rows_host(ids, max(1, (experts - 1).bit_length()), experts, out, layer_major) == -1
    got = out.reshape(5, 300, -1).transpose(1, 0, 2) if layer_major else out
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layer_major", [False, True])
@pytest.mark.parametrize("topk", [8, 11, 16])
def test_pack_at_every_width_never_writes_past_a_row_into_one_written_before(codec, topk, layer_major):
    # A group stores a whole word (8 or 16 bytes) where the bytes past it are rewritten later: at 1 bit a row
    # of eight IDs is one byte, so a word reaches seven rows ahead. Rows and layers both end inside a tile.
    rng = np.random.default_rng(topk)
    for bits in range(1, 17):
        for rows in (1, 3, 70):
            ids = rng.integers(0, 1 << bits, (rows, 3, topk)).astype(np.int32)
            want = pack_rows(ids, 1 << bits)
            out = np.full(want.size + 16, 0xEE, np.uint8)  # the 16 bytes past the step stay as they are
            step = out[:want.size].reshape((3, rows, -1) if layer_major else want.shape)
            assert pack_rows_host(ids, bits, 1 << bits, step, layer_major) == -1
            got = step.transpose(1, 0, 2) if layer_major else step
            np.testing.assert_array_equal(got, want, err_msg=f"bits {bits} rows {rows}")
            assert (out[want.size:] == 0xEE).all()


@pytest.mark.parametrize("layer_major", [False, True])
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_narrowing_stores_numpys_bytes_for_every_topk(codec, dtype, layer_major):
    rng = np.random.default_rng(len(dtype))
    high = min(np.iinfo(dtype).max, 1 << 20)
    for topk in range(1, 18):
        # 69 rows: a whole tile and an odd rest (two rows go at once where they can)
        ids = rng.integers(0 if dtype != "int32" else -high, high, (69, 3, topk)).astype(np.int32)
        want = ids.astype(dtype)
        out = np.full(want.shape, 7, dtype)
        limit = 0 if dtype == "int32" else high + 1
        assert narrow_rows_host(ids, limit, out.reshape(3, 69, topk) if layer_major else out, layer_major) == -1
        got = out.reshape(3, 69, topk).transpose(1, 0, 2) if layer_major else out
        np.testing.assert_array_equal(got, want, err_msg=f"topk {topk}")


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
@pytest.mark.parametrize("offset", [0, 8])
def test_a_large_step_narrowed_past_the_caches_holds_numpys_bytes(codec, dtype, offset):
    # From 1 MiB of output, rows of eight IDs in a layer's run are stored past the caches where the buffer is
    # 16-byte aligned (offset 0; 8 falls back to plain stores); an odd row count leaves one row of a tile alone.
    ids = np.random.default_rng(9).integers(0, 250, (2801, 48, 8)).astype(np.int32)
    itemsize = np.dtype(dtype).itemsize
    raw = np.full(ids.size * itemsize + 16, 0xEE, np.uint8)
    out = raw[offset:offset + ids.size * itemsize].view(dtype).reshape(48, 2801, 8)
    assert narrow_rows_host(ids, 256, out, True) == -1
    np.testing.assert_array_equal(out, ids.transpose(1, 0, 2).astype(dtype))
    assert (raw[:offset] == 0xEE).all() and (raw[offset + ids.size * itemsize:] == 0xEE).all()


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_narrowing_returns_the_first_id_out_of_range_and_canonicalize_names_it(codec, dtype):
    ids = np.random.default_rng(8).integers(0, 200, (1000, 5, 8)).astype(np.int32)
    ids[800, 2, 3], ids[700, 3, 1] = np.iinfo(dtype).max + 1, -1
    out = np.zeros((5, 1000, 8), dtype)
    assert narrow_rows_host(ids, np.iinfo(dtype).max + 1, out, True) == (700 * 5 + 3) * 8 + 1
    with pytest.raises(FieldValueError, match=rf"value -1 at index \[700, 3, 1\] does not fit {dtype}"):
        canonicalize("k", routed_experts_spec(5, 8, dtype), ids, out=np.zeros(ids.size * 2, np.uint8),
                     layer_major=True)


def test_pack_returns_the_first_bad_id_and_canonicalize_names_it(codec):
    ids = np.random.default_rng(4).integers(0, 384, (1000, 5, 8)).astype(np.int32)
    ids[700, 4, 7], ids[700, 1, 2], ids[900, 0, 0] = 384, -1, 999
    out = np.zeros((1000, 5, 9), np.uint8)
    assert pack_rows_host(ids, 9, 384, out, False) == (700 * 5 + 1) * 8 + 2
    with pytest.raises(FieldValueError, match=r"expert ID -1 at index \[700, 1, 2\] is outside \[0, 384\)"):
        canonicalize("k", routed_experts_spec(5, 8, "packed", 384), ids, layer_major=True)


def test_inputs_the_codec_does_not_take_are_left_to_numpy(codec):
    ids = np.random.default_rng(5).integers(0, 384, (10, 5, 8))
    out = np.zeros((10, 5, 9), np.uint8)
    for other in (ids.astype(">i4"), ids.astype(np.int64), np.asfortranarray(ids.astype(np.int32))):
        assert pack_rows_host(other, 9, 384, out, False) is None
    # canonicalize packs those with numpy: the same bytes
    spec = routed_experts_spec(5, 8, "packed", 384)
    np.testing.assert_array_equal(canonicalize("k", spec, ids.astype(">i4")), canonicalize("k", spec, ids.astype("<i4")))


def test_without_a_compiler_or_when_told_numpy_is_used(monkeypatch, tmp_path):
    monkeypatch.setattr(host_native, "_state", {})
    monkeypatch.setenv("GPUTQ_HOST_CODEC", "numpy")
    assert host_codec() is None and "GPUTQ_HOST_CODEC=numpy" in host_codec_status()
    monkeypatch.setattr(host_native, "_state", {})
    monkeypatch.delenv("GPUTQ_HOST_CODEC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang
    monkeypatch.delenv("CC", raising=False)
    assert host_codec() is None and "no C compiler" in host_codec_status()
    # the numpy path gives the same bytes
    ids = np.random.default_rng(6).integers(0, 100, (40, 3, 8))
    got = np.zeros((40, 8), np.int32)
    packed = pack_rows(ids, 100)
    np.testing.assert_array_equal(unpack_rows_host(np.ascontiguousarray(packed[:, 1]), 8, 7, got), ids[:, 1])


def test_a_failed_build_falls_back_and_says_why(monkeypatch, tmp_path):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(host_native, "_state", {})
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("GPUTQ_CACHE_DIR", str(tmp_path / "cache"))
    assert host_codec() is None
    assert "failed" in host_codec_status() and "internal error" in host_codec_status()


@pytest.mark.parametrize("native", [True, False], ids=["codec", "numpy"])
def test_a_layer_major_blobs_rows_unpack_token_major(codec, native, monkeypatch):
    # 600 tokens (chunks of 256 and a tail), rows 100..550 of a [5, 600, 9] blob into [450, 5, 8]
    if not native:
        monkeypatch.setattr(host_native, "host_codec", lambda: None)
    ids = np.random.default_rng(7).integers(0, 384, (600, 5, 8))
    blob = np.ascontiguousarray(pack_rows(ids, 384).transpose(1, 0, 2))
    out = np.full((450, 5, 8), -1, np.int32)
    host_native.unpack_token_major_host(blob[:, 100:550], 8, 9, out)  # layers 600 rows apart
    np.testing.assert_array_equal(out, ids[100:550])


def test_bench_kernels_plan_of_packed_rows_restores_what_the_token_row_plan_widens():
    # bits 8: one ID a byte, so the packed staging is the uint8 staging; token rows of L*K, packed rows of K
    from bench.kernel import packed_row_plan
    from gputq.kernels.reference import reference_widen_scatter

    rng = np.random.default_rng(8)
    layers, topk, src_rows, dst_rows = 3, 4, 30, 45
    plan = random_plan(rng, src_rows, dst_rows, max_frag=6)
    staging = rng.integers(0, 256, src_rows * layers * topk).astype(np.uint8)
    widened = reference_widen_scatter(staging, plan, layers * topk, np.full(dst_rows * layers * topk, -5, np.int32))
    unpacked = reference_unpack_scatter(staging, packed_row_plan(plan, layers), topk, 8,
                                        np.full(dst_rows * layers * topk, -5, np.int32))
    np.testing.assert_array_equal(unpacked, widened)


def test_processes_building_the_codec_at_once_each_load_a_whole_one(codec, tmp_path):
    # Four fresh processes, one empty cache folder: each compiles into its own temporary file and renames it.
    probe = ("from gputq.kernels.host_native import host_codec, host_codec_status as s; "
             "import sys; sys.exit(0 if host_codec() is not None else s())")
    env = {**os.environ, "GPUTQ_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", probe], env=env, stderr=subprocess.PIPE, text=True)
            for _ in range(4)]
    for run in runs:
        _, err = run.communicate(timeout=100)
        assert run.returncode == 0, err
    assert len(list(tmp_path.glob("host_codec-*.so"))) == 1 and not list(tmp_path.glob("tmp*"))


def test_bytewise_keeps_the_codec_at_an_id_at_a_time_with_the_same_bytes(monkeypatch):
    if host_codec() is None:
        pytest.skip(f"no host codec here: {host_codec_status()}")
    ids = np.random.default_rng(6).integers(0, 384, (64, 3, 8)).astype(np.int32)
    want = pack_rows(ids, 384)
    monkeypatch.setattr(host_native, "_state", {})
    monkeypatch.setenv("GPUTQ_HOST_CODEC", "bytewise")
    try:
        lib = host_codec()
        assert "an ID at a time (GPUTQ_HOST_CODEC=bytewise)" in host_codec_status()
        assert lib.gputq_set_paths(-1) == 0
        out = np.zeros(want.shape, np.uint8)
        assert pack_rows_host(ids, 9, 384, out, False) == -1
        np.testing.assert_array_equal(out, want)
    finally:
        lib.gputq_set_paths(host_native.PATH_BMI2 | host_native.PATH_VBMI | host_native.PATH_AVX512)
