"""``Writer.put`` on the caller's thread: one checked pass, the same errors, all fields or none."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.sends import SENDER_NICE, Buffers
from gputq.client.writer import Writer
from gputq.data.canonical import canonicalize
from gputq.data.fields import logprobs_spec, routed_experts_spec
from gputq.data.refs import Layout
from gputq.errors import FieldValueError, InvalidInputError
from tests.conftest import local_units

L, K = 48, 8


def _experts(rows, seed=0):
    return np.random.default_rng(seed).integers(0, 200, (rows, L, K), dtype=np.int32)


def _stored(services) -> list[tuple[int, int, int]]:
    return [(s.stats()["keys"], s.stats()["reserved"], s.stats()["puts"]) for s in services]


@pytest.mark.parametrize("dtype,value,message", [
    ("uint8", 256, "value 256 at index [5000, 3, 1] does not fit uint8 (range [0, 255])"),
    ("uint8", -1, "value -1 at index [5000, 3, 1] does not fit uint8 (range [0, 255])"),
    ("uint16", 65536, "value 65536 at index [5000, 3, 1] does not fit uint16 (range [0, 65535])"),
    ("uint16", -7, "value -7 at index [5000, 3, 1] does not fit uint16 (range [0, 65535])"),
])
def test_range_errors_are_raised_at_put_with_the_same_message(dtype, value, message):
    # 8,192 rows of int32 [48, 8] are 12 MiB: the bad ID sits in a late chunk of the pass.
    with local_units("tcp", units=2, routed_experts_dtype=dtype) as (config, services, clients):
        experts = _experts(8192)
        experts[5000, 3, 1] = value
        experts[6000, 0, 0] = value  # a later bad ID is not the one reported
        with Writer(clients, config) as writer:
            with pytest.raises(FieldValueError) as info:
                writer.put("p/s1/3", "p", {"routed_experts": experts})
            writer.flush()
        assert str(info.value) == f"key 'p/s1/3' field 'routed_experts': {message}"
        assert _stored(services) == [(0, 0, 0), (0, 0, 0)]


@pytest.mark.parametrize("value", [384, 511, -1])
def test_packed_ids_outside_num_experts_are_refused_at_put_naming_the_first(value):
    # 9 bits would hold 384..511: the check is against E, not the bits; nothing is stored.
    with local_units("tcp", units=2, routed_experts_dtype="packed", num_experts=384) as (config, services, clients):
        experts = _experts(8192)
        experts[5000, 3, 1] = value
        experts[6000, 0, 0] = value
        with Writer(clients, config) as writer:
            with pytest.raises(FieldValueError) as info:
                writer.put("p/s1/3", "p", {"routed_experts": experts})
            writer.flush()
        assert str(info.value) == (f"key 'p/s1/3' field 'routed_experts': expert ID {value} at index [5000, 3, 1] "
                                   f"is outside [0, 384) (num_experts 384); nothing was stored")
        assert _stored(services) == [(0, 0, 0), (0, 0, 0)]


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "auto"])
def test_whole_byte_ids_outside_a_configured_num_experts_are_refused_at_put(dtype):
    # GLM-4.5's 160 experts: uint8 (auto's choice too) holds 160..255, which no expert has; nothing is stored.
    with local_units("tcp", units=2, routed_experts_dtype=dtype, num_experts=160) as (config, services, clients):
        experts = np.random.default_rng(1).integers(0, 160, (8192, L, K), dtype=np.int32)
        experts[5000, 3, 1] = 160
        experts[6000, 0, 0] = 200
        with Writer(clients, config) as writer:
            with pytest.raises(FieldValueError) as info:
                writer.put("p/s1/3", "p", {"routed_experts": experts})
            writer.flush()
            assert _stored(services) == [(0, 0, 0), (0, 0, 0)]
            experts[5000, 3, 1] = experts[6000, 0, 0] = 159
            refs = writer.put("p/s1/3", "p", {"routed_experts": experts})
        assert str(info.value) == ("key 'p/s1/3' field 'routed_experts': expert ID 160 at index [5000, 3, 1] "
                                   "is outside [0, 160) (num_experts 160); nothing was stored")
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{f: Layout.from_ref(r) for f, r in refs.items()}])
        np.testing.assert_array_equal(got["rollout_routed_experts"], experts)


@pytest.mark.parametrize("experts,topk,row_bytes", [(128, 8, 7), (384, 8, 9), (512, 10, 12)])
def test_a_unit_stores_packed_rows_at_exactly_their_bytes(experts, topk, row_bytes):
    # The unit's own counters: ceil(K * b / 8) bytes a row and layer (uint8 would be 8, uint16 16 and 20).
    rows, layers = 1000, 5
    ids = np.random.default_rng(experts).integers(0, experts, (rows, layers, topk), dtype=np.int32)
    with local_units("tcp", units=1, routed_experts_dtype="packed", num_experts=experts) as (config, services, clients):
        with Writer(clients, config) as writer:
            ref = writer.put("k", "p", {"routed_experts": ids})["routed_experts"]
            writer.flush()
        assert (ref.dtype, ref.row_shape, ref.stored_shape, ref.num_experts) == \
            ("uint8", (layers, topk), (layers, row_bytes), experts)
        assert services[0].stats()["bytes_written"] == rows * layers * row_bytes
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{"routed_experts": Layout.from_ref(ref)}])
        np.testing.assert_array_equal(got["rollout_routed_experts"], ids)
        assert services[0].stats()["bytes_read"] == rows * layers * row_bytes


def test_int64_ids_into_int32_storage_are_range_checked():
    with local_units("tcp", units=1, routed_experts_dtype="int32") as (config, _, clients):
        experts = _experts(64).astype(np.int64)
        experts[63, 47, 7] = 2**31
        with Writer(clients, config) as writer, pytest.raises(FieldValueError) as info:
            writer.put("k", "p", {"routed_experts": experts})
        assert str(info.value) == ("key 'k' field 'routed_experts': value 2147483648 at index [63, 47, 7] "
                                   "does not fit int32 (range [-2147483648, 2147483647])")


@pytest.mark.parametrize("fields,error,message", [
    ({"logprobs": np.array([-1.0, -2.0, -3.0, np.nan, np.nan], np.float32)}, FieldValueError,
     "key 'k' field 'logprobs': NaN at index [3]"),
    ({"logprobs": np.zeros((3, 1), np.float32)}, FieldValueError,
     "key 'k' field 'logprobs': expected shape [rows], got (3, 1)"),
    ({"logprobs": np.zeros(3, np.int32)}, FieldValueError,
     "key 'k' field 'logprobs': expected a floating-point array, got dtype int32"),
    ({"routed_experts": np.zeros((3, L, K), np.float32)}, FieldValueError,
     "key 'k' field 'routed_experts': expected an integer array, got dtype float32"),
    ({"routed_experts": np.zeros((3, L), np.int32)}, InvalidInputError,
     "routed_experts must be [rows, num_layers, topk], got shape (3, 48)"),
    ({"entropy": np.zeros(3, np.float32)}, InvalidInputError,
     "no field spec for 'entropy'; register it in a FieldRegistry"),
])
def test_input_errors_are_raised_at_put_with_the_same_message(fields, error, message):
    with local_units("tcp", units=1) as (config, services, clients):
        with Writer(clients, config) as writer:
            with pytest.raises(error) as info:
                writer.put("k", "p", fields)
            writer.flush()
        assert str(info.value) == message and isinstance(info.value, ValueError)
        assert _stored(services) == [(0, 0, 0)]


def test_nan_in_a_late_chunk_names_its_index():
    logprobs = np.full(1 << 20, -0.5, np.float64)  # 8 MiB of float64: several chunks
    logprobs[900_000] = np.nan
    with local_units("tcp", units=1) as (config, _, clients), Writer(clients, config) as writer:
        with pytest.raises(FieldValueError) as info:
            writer.put("k", "p", {"logprobs": logprobs})
    assert str(info.value) == "key 'k' field 'logprobs': NaN at index [900000]"


@pytest.mark.parametrize("bad", ["range", "nan"])
def test_nothing_is_stored_after_a_failed_put(bad):
    with local_units("tcp", units=2, routed_experts_dtype="uint8") as (config, services, clients):
        experts, logprobs = _experts(300), np.full(300, -1.0, np.float32)
        if bad == "range":
            experts[299, 0, 0] = 1000
        else:
            logprobs[299] = np.nan
        # The good field first: it is checked and compacted, then dropped with the put.
        fields = {"logprobs": logprobs, "routed_experts": experts} if bad == "range" else \
            {"routed_experts": experts, "logprobs": logprobs}
        with Writer(clients, config) as writer:
            with pytest.raises(FieldValueError, match="'k'"):
                writer.put("k", "p", fields)
            writer.flush()
            assert writer.bytes_written == 0
            assert _stored(services) == [(0, 0, 0), (0, 0, 0)]
            # Nothing is left pending either: the same key can be put once fixed.
            experts[299, 0, 0], logprobs[299] = 7, -1.0
            refs = writer.put("k", "p", {"routed_experts": experts, "logprobs": logprobs})
            writer.flush()
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{f: Layout.from_ref(r) for f, r in refs.items()}])
        assert np.array_equal(got["rollout_routed_experts"], experts)
        assert np.array_equal(got["rollout_log_probs"], logprobs)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_caller_may_reuse_its_int32_buffer_right_after_put(dtype):
    with local_units("tcp", units=1, routed_experts_dtype=dtype) as (config, _, clients):
        experts = _experts(2048)  # 3 MiB of int32
        expected = experts.copy()
        with Writer(clients, config) as writer:
            refs = writer.put("k", "p", {"routed_experts": experts})
            experts[:] = 255  # the engine reuses its output buffer at once
            writer.flush()
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{"routed_experts": Layout.from_ref(refs["routed_experts"])}])
        assert np.array_equal(got["rollout_routed_experts"], expected)


def test_canonicalize_into_out_is_one_owned_copy():
    spec = routed_experts_spec(L, K, "uint16")
    src = _experts(1000)
    out = np.empty(1000 * L * K * 2 + 64, np.uint8)
    got = canonicalize("k", spec, src, out=out)
    assert got.dtype == np.uint16 and got.shape == src.shape and got.flags.c_contiguous
    assert np.shares_memory(got, out) and not np.shares_memory(got, src)
    assert np.array_equal(got, src)
    same = routed_experts_spec(L, K, "int32")  # no narrowing: still the caller's own copy
    copied = canonicalize("k", same, src, out=np.empty(src.nbytes, np.uint8))
    assert not np.shares_memory(copied, src) and np.array_equal(copied, src)
    lp = np.linspace(-3, 0, 500, dtype=np.float32)
    assert np.array_equal(canonicalize("k", logprobs_spec(), lp, out=np.empty(2000, np.uint8)), lp)
    with pytest.raises(InvalidInputError, match="at least 2000 bytes"):
        canonicalize("k", logprobs_spec(), lp, out=np.empty(1999, np.uint8))
    strided = src[::2]  # a non-contiguous input converts chunk by chunk all the same
    assert np.array_equal(canonicalize("k", spec, strided, out=np.empty(strided.size * 2, np.uint8)), strided)


def test_buffers_are_reused_within_the_bound():
    buffers = Buffers(limit=8 << 20)
    first = buffers.take(3 << 20)
    assert first.nbytes == Buffers.size_class(3 << 20) >= 3 << 20
    buffers.give(first, inflight=0)
    assert buffers.take((3 << 20) - 1000) is first  # a slightly shorter step reuses it
    buffers.give(first, inflight=0)
    assert buffers.take(1 << 20) is not first  # far too large for it: not wasted on it
    assert buffers.take(3 << 20) is first
    buffers.give(first, inflight=6 << 20)  # kept + in flight would pass the bound: dropped
    assert buffers.take(3 << 20) is not first
    small = buffers.take(1000)
    assert small.nbytes == 1000
    buffers.give(buffers.take(3 << 20), inflight=0)
    buffers.clear()
    assert buffers._kept == 0 and buffers.take(3 << 20) is not first
    assert [Buffers.size_class(n) for n in (1, 4096, 4097, 1 << 20, (1 << 20) + 1)] == [
        4096, 4096, 8192, 1 << 20, (1 << 20) + (1 << 17)]


@pytest.mark.timeout(60)
def test_sent_buffers_are_back_in_the_pool_when_flush_returns(monkeypatch):
    """A put right after flush() reuses a sent buffer: a fresh one faults in a page per 4 KiB."""
    with local_units("tcp", units=1, routed_experts_dtype="uint16") as (config, _, clients), \
            Writer(clients, config) as writer:
        experts = np.random.default_rng(1).integers(0, 100, (1024, 8, 8), dtype=np.int32)  # 128 KiB stored
        window, taken = threading.Event(), []
        real_give, real_take = writer._sends.buffers.give, writer._sends.buffers.take

        def slow_give(buffer, inflight):
            window.wait(0.2)  # the window in which an early flush() used to return
            real_give(buffer, inflight)

        def take(nbytes):
            taken.append(real_take(nbytes))
            return taken[-1]

        monkeypatch.setattr(writer._sends.buffers, "give", slow_give)
        monkeypatch.setattr(writer._sends.buffers, "take", take)
        for round_ in range(5):
            taken.clear()
            for i in range(3):
                writer.put(f"r{round_}/{i}", "p", {"routed_experts": experts})
            writer.flush(timeout=30)
            # Every buffer the round's puts took is back (on a slow host a put may reuse one already back).
            kept = {id(buffer) for buffer in writer._sends.buffers.kept()}
            assert len(taken) == 3 and all(id(buffer) in kept for buffer in taken), f"round {round_}"


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are a Linux feature")
def test_senders_run_below_the_callers_priority():
    with local_units("tcp", units=1) as (config, _, clients), Writer(clients, config) as writer:
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        sends = writer._sends
        sender = sends._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(10)
        assert sender == min(19, own + SENDER_NICE)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller keeps its own
