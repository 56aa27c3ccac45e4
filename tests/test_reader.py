"""The reader's staging layout and request count."""

from __future__ import annotations

import numpy as np

from gputq.reader import READ_BATCH_KEYS, Reader, _lay_out, _stage_field
from gputq.refs import FieldRef, Layout
from gputq.writer import Writer

from .conftest import local_units


def _ref(unit, key, field, rows, dtype, row_shape):
    return FieldRef(key=key, field=field, unit=unit, rows=rows, dtype=dtype, row_shape=row_shape, partition="p")


def test_one_request_per_unit_when_rows_align():
    samples = []
    for i in range(5):
        unit = f"su-{i % 2}"
        samples.append({"routed_experts": Layout.from_ref(_ref(unit, f"s{i}/re", "routed_experts", 10 + i,
                                                               "uint16", (48, 8))),
                        "logprobs": Layout.from_ref(_ref(unit, f"s{i}/lp", "logprobs", 10 + i, "float32", ()))})
    stages = [_stage_field(name, [s[name] for s in samples]) for name in ("logprobs", "routed_experts")]
    requests, total = _lay_out(stages)
    assert [r.unit for r in requests] == ["su-0", "su-1"]
    assert sorted(k for r in requests for k in r.keys) == sorted(f"s{i}/{f}" for i in range(5) for f in ("re", "lp"))
    assert total % 16 == 0 and total >= requests[-1].stop


def test_misaligned_row_sizes_split_requests_and_restore_exactly():
    # 6-byte expert rows (uint16 [1, 3]) then 4-byte logprob rows: 35 expert rows end at byte 210,
    # not a multiple of 4, so the logprobs need padding and a request of their own.
    with local_units("tcp", units=1, routed_experts_dtype="uint16") as (config, _, clients):
        rng = np.random.default_rng(3)
        rows = [7, 8, 9, 11]
        data = [(rng.integers(0, 500, (n, 1, 3)).astype(np.int32), rng.random(n, dtype=np.float32)) for n in rows]
        with Writer(clients, config) as writer:
            refs = [writer.put(f"k{i}", "p", {"routed_experts": e, "logprobs": lp}) for i, (e, lp) in enumerate(data)]
            writer.flush()
        shard = [{f: Layout.from_ref(r) for f, r in ref.items()} for ref in refs]
        stages = [_stage_field(name, [s[name] for s in shard]) for name in ("logprobs", "routed_experts")]
        requests, total = _lay_out(stages)
        assert [(r.start, r.stop) for r in requests] == [(0, 210), (212, 212 + 4 * 35)]
        assert total == 352  # rounded up to 16 bytes
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
        calls = []
        for unit in clients.units:
            channel = clients.channel(unit)
            original = channel.read

            def counting(keys, dest, timeout=None, _original=original, _unit=unit):
                calls.append((_unit, len(keys)))
                return _original(keys, dest, timeout=timeout)

            channel.read = counting
        with Reader(clients, config) as reader:
            got = reader.fetch(shard)
        units_used = {r["logprobs"].unit for r in refs}
        assert sorted(u for u, _ in calls) == sorted(units_used)  # one request per unit
        assert sum(n for _, n in calls) == 24
        for i, fields in enumerate(got):
            assert np.array_equal(fields["rollout_routed_experts"], np.full((9, 4, 2), i, np.int32))
            assert np.array_equal(fields["rollout_log_probs"], np.full(9, -i, np.float32))


def test_key_lists_are_split_at_the_batch_bound():
    samples = [{"logprobs": Layout.from_ref(_ref("su-0", f"k{i:06d}", "logprobs", 1, "float32", ()))}
               for i in range(READ_BATCH_KEYS + 5)]
    requests, _ = _lay_out([_stage_field("logprobs", [s["logprobs"] for s in samples])])
    assert [len(r.keys) for r in requests] == [READ_BATCH_KEYS, 5]
    assert requests[1].start == requests[0].stop  # contiguous: no padding needed
