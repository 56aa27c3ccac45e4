"""The whole-shard plan's staging layout and requests, version checks and exactly-once release."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.plan import READ_BATCH_KEYS, plan_shard
from gputq.client.writer import Writer
from gputq.data.refs import FieldRef, Layout
from gputq.errors import GputqError, InvalidInputError, PartialFailureError, StaleReadError
from tests.conftest import local_units

KIB = 1 << 10


def _ref(unit, key, field, rows, dtype, row_shape, incarnation="", generation=0):
    return FieldRef(key=key, field=field, unit=unit, rows=rows, dtype=dtype, row_shape=row_shape, partition="p",
                    incarnation=incarnation, generation=generation)


def _spy_reads(clients):
    """Record every channel read as (unit, keys, generations, incarnation); still read for real. A whole
    shard reads whole keys: no spans."""
    calls = []
    for unit in clients.units:
        channel = clients.channel(unit)
        original = channel.read

        def spy(keys, dest, timeout=None, *, generations=None, incarnation=None, spans=None, _original=original,
                _unit=unit):
            assert spans is None
            calls.append((_unit, list(keys), generations, incarnation))
            return _original(keys, dest, timeout=timeout, generations=generations, incarnation=incarnation)

        channel.read = spy
    return calls


def test_one_request_per_unit_when_rows_align():
    samples = []
    for i in range(5):
        unit = f"su-{i % 2}"
        samples.append({"routed_experts": Layout.from_ref(_ref(unit, f"s{i}/re", "routed_experts", 10 + i,
                                                               "uint16", (48, 8))),
                        "logprobs": Layout.from_ref(_ref(unit, f"s{i}/lp", "logprobs", 10 + i, "float32", ()))})
    plan = plan_shard(samples)
    requests, total = plan.requests, plan.nbytes
    assert [r.unit for r in requests] == ["su-0", "su-1"]
    assert all(r.spans is None for r in requests)  # whole keys, read by name
    assert sorted(k for r in requests for k in r.keys) == sorted(f"s{i}/{f}" for i in range(5) for f in ("re", "lp"))
    assert total % 16 == 0 and total >= requests[-1].stop


def test_misaligned_row_sizes_split_requests_and_restore_exactly():
    # 6-byte expert rows (uint16 [1, 3]) then 4-byte logprob rows: 35 expert rows end at byte 210,
    # not a multiple of 4, so the logprobs need padding (to 16 bytes) and a request of their own.
    with local_units("tcp", units=1, routed_experts_dtype="uint16") as (config, _, clients):
        rng = np.random.default_rng(3)
        rows = [7, 8, 9, 11]
        data = [(rng.integers(0, 500, (n, 1, 3)).astype(np.int32), rng.random(n, dtype=np.float32)) for n in rows]
        with Writer(clients, config) as writer:
            refs = [writer.put(f"k{i}", "p", {"routed_experts": e, "logprobs": lp}) for i, (e, lp) in enumerate(data)]
            writer.flush()
        shard = [{f: Layout.from_ref(r) for f, r in ref.items()} for ref in refs]
        plan = plan_shard(shard)
        assert [(r.start, r.stop) for r in plan.requests] == [(0, 210), (224, 224 + 4 * 35)]
        assert plan.nbytes == 368  # rounded up to 16 bytes
        with Reader(clients, config) as reader:
            got = reader.fetch(shard)
        for (experts, logprobs), fields in zip(data, got):
            assert np.array_equal(fields["rollout_routed_experts"], experts)
            assert np.array_equal(fields["rollout_log_probs"], logprobs)


def test_reader_sends_one_read_per_unit_for_all_fields():
    with local_units("tcp", units=2) as (config, _, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}/0", "p", {"routed_experts": np.full((9, 4, 2), i, np.int32),
                                                "logprobs": np.full(9, -i, np.float32)}) for i in range(12)]
            writer.flush()
        shard = [{f: Layout.from_ref(r) for f, r in ref.items()} for ref in refs]
        calls = _spy_reads(clients)
        with Reader(clients, config) as reader:
            got = reader.fetch(shard)
        units_used = {r["logprobs"].unit for r in refs}
        assert sorted(u for u, *_ in calls) == sorted(units_used)  # one request per unit
        assert sum(len(keys) for _, keys, *_ in calls) == 24
        for i, fields in enumerate(got):
            assert np.array_equal(fields["rollout_routed_experts"], np.full((9, 4, 2), i, np.int32))
            assert np.array_equal(fields["rollout_log_probs"], np.full(9, -i, np.float32))


def test_key_lists_are_split_at_the_batch_bound():
    samples = [{"logprobs": Layout.from_ref(_ref("su-0", f"k{i:06d}", "logprobs", 1, "float32", ()))}
               for i in range(READ_BATCH_KEYS + 5)]
    requests = plan_shard(samples).requests
    assert [len(r.keys) for r in requests] == [READ_BATCH_KEYS, 5]
    assert requests[1].start == requests[0].stop  # contiguous: no padding needed


def test_requests_are_split_by_bytes_under_the_frame_limit():
    samples = [{"logprobs": Layout.from_ref(_ref("su-0", f"k{i}", "logprobs", 150 * KIB, "float32", ()))}
               for i in range(3)]  # 600 KiB each
    requests = plan_shard(samples, max_bytes=1 << 20).requests
    assert [(r.keys, r.start, r.stop) for r in requests] == [
        (["k0"], 0, 600 * KIB), (["k1"], 600 * KIB, 1200 * KIB), (["k2"], 1200 * KIB, 1800 * KIB)]
    requests = plan_shard(samples, max_bytes=1200 * KIB).requests
    assert [r.keys for r in requests] == [["k0", "k1"], ["k2"]]  # exactly at the limit still fits
    # A single key over the limit goes alone (the transport refuses it with a typed error).
    requests = plan_shard(samples, max_bytes=100 * KIB).requests
    assert [r.keys for r in requests] == [["k0"], ["k1"], ["k2"]]


def test_shard_larger_than_the_frame_limit_restores_bit_exact():
    # Two 600 KiB keys under a 1 MiB frame limit: one request would be refused as too large.
    with local_units("tcp", units=1, max_frame_bytes=1 << 20) as (config, _, clients):
        rng = np.random.default_rng(7)
        data = [rng.standard_normal(150 * KIB).astype(np.float32) for _ in range(2)]
        with Writer(clients, config) as writer:
            refs = [writer.put(f"big{i}", "p", {"logprobs": lp}) for i, lp in enumerate(data)]
            writer.flush()
        shard = [{"logprobs": Layout.from_ref(r["logprobs"])} for r in refs]
        calls = _spy_reads(clients)
        with Reader(clients, config) as reader:
            got = reader.fetch(shard)
        assert [keys for _, keys, *_ in calls] == [["big0/logprobs"], ["big1/logprobs"]]
        for lp, fields in zip(data, got):
            assert fields["rollout_log_probs"].tobytes() == lp.tobytes()


def test_reads_carry_the_references_generations_and_incarnation():
    with local_units("tcp", units=2) as (config, _, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"routed_experts": np.full((3, 2, 2), i, np.int32),
                                              "logprobs": np.full(3, -i, np.float32)}) for i in range(6)]
            writer.flush()
        shard = [{f: Layout.from_ref(r) for f, r in ref.items()} for ref in refs]
        by_key = {r.key: r for ref in refs for r in ref.values()}
        calls = _spy_reads(clients)
        with Reader(clients, config) as reader:
            reader.fetch(shard)
        assert sorted(k for _, keys, *_ in calls for k in keys) == sorted(by_key)
        for unit, keys, generations, incarnation in calls:
            assert generations == [by_key[k].generation for k in keys]
            assert all(g >= 1 for g in generations)
            assert incarnation == (by_key[keys[0]].incarnation or None)
            assert all(by_key[k].unit == unit for k in keys)


def test_one_request_per_incarnation_of_a_unit():
    old = _ref("su-0", "a", "logprobs", 4, "float32", (), "aaaaaaaaaaaaaaaa", 5)
    new = _ref("su-0", "b", "logprobs", 4, "float32", (), "bbbbbbbbbbbbbbbb", 6)
    requests = plan_shard([{"logprobs": Layout.from_ref(old)}, {"logprobs": Layout.from_ref(new)}]).requests
    assert [(r.incarnation, r.keys, r.generations) for r in requests] == [
        ("aaaaaaaaaaaaaaaa", ["a"], [5]), ("bbbbbbbbbbbbbbbb", ["b"], [6])]


def test_two_versions_of_one_key_in_a_shard_are_stale():
    first = _ref("su-0", "k", "logprobs", 4, "float32", (), "aaaaaaaaaaaaaaaa", 5)
    rewritten = _ref("su-0", "k", "logprobs", 4, "float32", (), "aaaaaaaaaaaaaaaa", 9)
    with pytest.raises(StaleReadError, match=r"the shard references two versions of key 'k' on unit su-0"):
        plan_shard([{"logprobs": Layout.from_ref(first)}, {"logprobs": Layout.from_ref(rewritten)}])
    unknown = _ref("su-0", "k", "logprobs", 4, "float32", ())  # unknown version: nothing to compare
    requests = plan_shard([{"logprobs": Layout.from_ref(first)}, {"logprobs": Layout.from_ref(unknown)}]).requests
    assert [(r.keys, r.generations, r.incarnation) for r in requests] == [(["k"], [5], "aaaaaaaaaaaaaaaa")]


def _spy_calls(clients):
    calls = []
    for unit in clients.units:
        channel = clients.channel(unit)
        original = channel.call

        def spy(method, timeout=None, _original=original, _unit=unit, **args):
            calls.append((_unit, method, args))
            return _original(method, timeout=timeout, **args)

        channel.call = spy
    return calls


def test_default_release_id_names_the_reader_and_the_shard():
    with local_units("tcp", units=1) as (config, _, clients):
        shard = [{"logprobs": Layout.from_ref(_ref("su-0", f"k{i}", "logprobs", 2, "float32", ()))} for i in range(3)]
        with Reader(clients, config, reader_id="rank-0") as r0, Reader(clients, config, reader_id="rank-1") as r1, \
                Reader(clients, config) as anonymous:
            uses = {"su-0": ["k0", "k1", "k2"]}
            same = r0._default_release_id(uses, "p")
            assert same.startswith("rank-0/") and same == r0._default_release_id({"su-0": ["k2", "k0", "k1"]}, "p")
            assert r1._default_release_id(uses, "p") != same  # another rank's release is another release
            assert r0._default_release_id({"su-0": ["k0", "k1"]}, "p") != same
            assert r0._default_release_id({"su-0": ["k0", "k1", "k2", "k2"]}, "p") != same  # counts matter
            assert r0._default_release_id(uses, "q") != same
            assert len(anonymous.reader_id) == 32 and anonymous.reader_id != Reader(clients, config).reader_id
            with pytest.raises(InvalidInputError, match="release_id"):
                r0.release(shard, "p", release_id="")
        with pytest.raises(InvalidInputError, match="reader_id"):
            Reader(clients, config, reader_id="")


def test_a_repeated_release_frees_nothing_more():
    with local_units("tcp", units=1) as (config, services, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"logprobs": np.full(4, -i, np.float32)}) for i in range(2)]
            writer.flush()
            shard = [{"logprobs": Layout.from_ref(r["logprobs"])} for r in refs]
            # Two ranks each hold one reference per step (two segments share the steps).
            writer.finalize(shard + shard, "p")
        calls = _spy_calls(clients)
        with Reader(clients, config, reader_id="rank-0") as rank0, Reader(clients, config, reader_id="rank-1") as rank1:
            rank0.release(shard, "p")
            rank0.release(shard, "p")  # a retry: must not take rank 1's references
            assert services[0].stats()["keys"] == 2
            (got,) = rank1.fetch(shard[:1])
            assert np.array_equal(got["rollout_log_probs"], np.zeros(4, np.float32))
            rank1.release(shard, "p")
        assert services[0].stats()["keys"] == 0 and services[0].stats()["used"] == 0
        ids = [args["release_id"] for _, method, args in calls if method == "release"]
        assert len(ids) == 3 and ids[0] == ids[1] != ids[2]


def test_release_frees_every_reachable_unit_and_names_the_lost_one():
    with local_units("tcp", units=3) as (config, services, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"logprobs": np.full(4, i, np.float32)}) for i in range(30)]
            writer.flush()
        shard = [{"logprobs": Layout.from_ref(r["logprobs"])} for r in refs]
        on = {s.name: s.stats()["keys"] for s in services}
        assert all(on.values())  # every unit holds some of the shard
        # The lost unit comes first in the shard: the old loop stopped there and freed nothing.
        first = shard[0]["logprobs"].refs()[0].unit
        lost = next(s for s in services if s.name == first)
        lost.close()
        survivors = [s for s in services if s is not lost]
        with Reader(clients, config, reader_id="rank-0") as reader:
            with pytest.raises(PartialFailureError, match=f"unreachable: {first}: unit {first} is lost") as info:
                reader.release(shard, "p")
        assert info.value.result == {"freed": sum(on[s.name] for s in survivors),
                                     "unreachable": {first: info.value.result["unreachable"][first]}}
        assert isinstance(info.value, GputqError) and set(clients.lost) == {first}
        assert [s.stats()["keys"] for s in survivors] == [0, 0]
        assert [s.stats()["used"] for s in survivors] == [0, 0]


def test_release_returns_the_keys_freed():
    with local_units("tcp", units=2) as (config, services, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"logprobs": np.full(4, i, np.float32)}) for i in range(6)]
            writer.flush()
        shard = [{"logprobs": Layout.from_ref(r["logprobs"])} for r in refs]
        with Reader(clients, config) as reader:
            assert reader.release(shard, "p") == {"freed": 6, "unreachable": {}}
            assert reader.release(shard, "p") == {"freed": 0, "unreachable": {}}  # the same release: a no-op
        assert [s.stats()["keys"] for s in services] == [0, 0]


#: Stored formats of the layer-major restore: uint16, and packed IDs (10 bits) read in place or copied out (shm).
_FORMATS = {"uint16": {"routed_experts_dtype": "uint16"},
            "packed": {"routed_experts_dtype": "packed", "num_experts": 1000},
            "packed-copied": {"routed_experts_dtype": "packed", "num_experts": 1000, "zero_copy_max_bytes": 0}}


@pytest.mark.parametrize("stored", sorted(_FORMATS))
@pytest.mark.parametrize("with_torch", [True, False], ids=["torch-transpose", "numpy-transpose"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_layer_major_blobs_restore_token_major_with_or_without_torch(transport, with_torch, stored, monkeypatch):
    """Stored ``[L, rows, K]``, returned ``[rows, L, K]``: composed layouts (a slice, a shifted step, fill rows),
    over tcp (the staged gather) and shm (widened in place, then transposed), with torch's copy or numpy's."""
    from gputq.client import host_restore

    if with_torch:
        pytest.importorskip("torch", reason="the torch transpose needs torch")  # loaded, as in a trainer
    else:
        monkeypatch.setattr(host_restore, "host_torch", lambda dtype: None)
    with local_units(transport, units=2, **_FORMATS[stored]) as (config, _, clients):
        rng = np.random.default_rng(11)
        steps = [rng.integers(0, 1000, (n, 6, 3)).astype(np.int32) for n in (700, 1300, 90)]
        with Writer(clients, config) as writer:
            refs = [writer.put(f"t{i}", "p", {"routed_experts": e})["routed_experts"] for i, e in enumerate(steps)]
            writer.flush()
        whole = [Layout.from_ref(r) for r in refs]
        shard = [{"routed_experts": Layout.concat([whole[0].slice(100, 650), whole[2]])},
                 {"routed_experts": whole[1].shift(40, 1400)},
                 {"routed_experts": whole[2]}]
        want = [np.concatenate([steps[0][100:650], steps[2]]),
                np.concatenate([np.zeros((40, 6, 3), np.int32), steps[1], np.zeros((60, 6, 3), np.int32)]),
                steps[2]]
        with Reader(clients, config) as reader:
            got = reader.fetch(shard)
        for sample, expected in zip(got, want):
            assert sample["rollout_routed_experts"].dtype == np.int32
            np.testing.assert_array_equal(sample["rollout_routed_experts"], expected)


def test_a_torch_without_uint16_tensors_leaves_uint16_blobs_to_numpy(monkeypatch):
    import types

    from gputq.client import host_restore

    old_torch = types.SimpleNamespace(__version__="2.1.0")  # torch before 2.3: no torch.uint16
    monkeypatch.setitem(sys.modules, "torch", old_torch)
    assert host_restore.host_torch(np.dtype(np.uint16)) is None
    assert host_restore.host_torch(np.dtype(np.uint8)) is old_torch
    monkeypatch.delitem(sys.modules, "torch")
    assert host_restore.host_torch(np.dtype(np.int32)) is None  # not loaded: gputq does not import it


def test_a_stream_buffer_is_lent_from_the_smallest_that_fit_the_one_given_back_last():
    """Of the buffers earlier streams gave back, the smallest that fit, and of those the warmest in cache."""
    import contextlib

    from gputq.client.read_context import Buffers

    buffers = Buffers("cpu")
    with contextlib.ExitStack() as first:
        large, one, other = buffers.lend(1000, first), buffers.lend(100, first), buffers.lend(100, first)
        # Given back in reverse: other, one, then large.
    with contextlib.ExitStack() as second:
        assert buffers.lend(100, second).base is one.base  # of the two smallest, the one given back last
        assert buffers.lend(100, second).base is other.base
        assert buffers.lend(100, second).base is large.base  # the only one left that fits
    buffers.close()
    with contextlib.ExitStack() as third:
        fresh = buffers.lend(100, third).base  # closed: none was kept
        assert all(fresh is not kept.base for kept in (one, other, large))


@pytest.mark.parametrize("dtype", ["uint16", "packed"])
@pytest.mark.parametrize("shift", [1, 2])
def test_a_whole_shard_read_on_a_misaligned_directory_hint_is_read_again_after_its_lease(monkeypatch, dtype, shift):
    """A torn or foreign directory entry may name any bytes: the in-place restore on ones ``shift`` bytes off
    (misaligned for the float32 logprobs) fails, the lease names other regions, and the shard is read again
    after its lease, exactly, instead of the restore's PlanError reaching the caller."""
    from gputq.transport.directory import DirectoryView

    lookup, lookups = DirectoryView.lookup, []

    def stale_once(self, keys, generations, *, within=None):
        regions = lookup(self, keys, generations, within=within)
        lookups.append(True)
        if regions is not None and len(lookups) == 1:
            regions = regions.copy()
            regions[:, 0] += shift
        return regions

    monkeypatch.setattr(DirectoryView, "lookup", stale_once)
    rng = np.random.default_rng(shift)
    with local_units("shm", units=1, routed_experts_dtype=dtype, num_experts=16) as (config, _, clients):
        with Writer(clients, config) as writer:
            data = [(rng.integers(0, 16, (n - 1, 6, 4)).astype(np.int32), rng.standard_normal(n).astype(np.float32))
                    for n in (37, 50, 64)]
            refs = [writer.put(f"s{i}/0", "p", {"routed_experts": e, "logprobs": lp}) for i, (e, lp) in
                    enumerate(data)]
        with Reader(clients, config) as reader:
            got = reader.fetch([{f: Layout.from_ref(r) for f, r in step.items()} for step in refs])
        assert lookups and clients.channel(clients.units[0]).hint_misses == 1
    for sample, (experts, log_probs) in zip(got, data):
        np.testing.assert_array_equal(sample["rollout_routed_experts"], experts)
        np.testing.assert_array_equal(sample["rollout_log_probs"], log_probs)
