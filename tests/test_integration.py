"""The whole path in-process over real sockets (and NIXL where present)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import FieldRef, Layout
from gputq.data.trajectory import inline_fields, lineage_segments, timeline_segments
from gputq.errors import CapacityError, UnknownKeyError
from gputq.tools.synthetic import SyntheticConfig, build_sessions
from gputq.transport.handler import ServerLimits
from tests.waiting import wait_until

from .conftest import local_units

SYNTH = dict(sessions=3, steps_per_session=3, layers=3, topk=4, num_experts=200, prompt_tokens=40,
             tokens_per_step=30, tool_tokens=6, branch_prob=0.5, rewrite_prob=0.3, seed=7)


def _assert_same(restored: dict, expected: dict) -> None:
    assert set(restored) == set(expected)
    for name, want in expected.items():
        got = np.asarray(restored[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "packed"])
def test_both_views_restore_bit_exact(transport_name, dtype):
    synth = SyntheticConfig(**SYNTH)
    with local_units(transport_name, routed_experts_dtype=dtype, num_experts=synth.num_experts) as (config, services,
                                                                                                 clients):
        fields = config.field_registry(synth.layers, synth.topk)
        with Writer(clients, config) as writer:
            sessions = build_sessions(synth, fields=fields, writer=writer)
            writer.flush()
        with Reader(clients, config) as reader:
            for view in (timeline_segments, lineage_segments):
                segments = [seg for s in sessions for seg in view(s)]
                restored = reader.fetch([seg.layouts for seg in segments])
                for seg, got in zip(segments, restored):
                    _assert_same(got, inline_fields(seg))
                    experts = got["rollout_routed_experts"]
                    assert experts.dtype == np.int32 and experts.shape == (len(seg.tokens) - 1, 3, 4)
                    assert got["rollout_log_probs"].shape == (seg.response_len,)
        written = {ref.key for s in sessions for step in s.steps for ref in step.refs.values()}
        assert sum(s.stats()["keys"] for s in services) == len(written)


def test_shared_steps_are_fetched_once_per_shard():
    synth = SyntheticConfig(**{**SYNTH, "rewrite_prob": 0.0, "branch_prob": 0.0})
    with local_units("tcp") as (config, _, clients):
        with Writer(clients, config) as writer:
            sessions = build_sessions(synth, writer=writer)
            writer.flush()
        segments = [seg for s in sessions for seg in timeline_segments(s)]
        with Reader(clients, config) as reader:
            reader.fetch([seg.layouts for seg in segments])
            stats = reader.last_stats
        distinct = {(r.unit, r.key) for seg in segments for lay in seg.layouts.values() for r in lay.refs()}
        assert stats.unique_keys == len(distinct)
        assert stats.referenced_keys > stats.unique_keys  # timeline segments share prefix steps
        assert sum(stats.unique_keys_per_unit.values()) == stats.unique_keys
        unique = {(r.unit, r.key): r for seg in segments for lay in seg.layouts.values() for r in lay.refs()}
        assert stats.bytes_fetched == sum(r.nbytes for r in unique.values())


def test_unknown_key_is_a_typed_error(transport_name):
    with local_units(transport_name) as (config, _, clients):
        ghost = FieldRef(key="nope/0/routed_experts", field="routed_experts", unit="su-0", rows=4,
                         dtype="uint16", row_shape=(2, 2), partition="p")
        with Reader(clients, config) as reader:
            with pytest.raises(UnknownKeyError, match="nope/0/routed_experts"):
                reader.fetch([{"routed_experts": Layout.from_ref(ghost)}])


def test_commit_region_rolls_back_on_local_failure():
    with local_units("tcp") as (config, services, clients):
        with Writer(clients, config) as writer:
            experts = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 7
            with pytest.raises(RuntimeError, match="local commit failed"):
                with writer.commit_region() as region:
                    for i in range(6):
                        region.put(f"r0/s{i}/0", "r0", {"routed_experts": experts,
                                                        "logprobs": np.zeros(5, np.float32)})
                    raise RuntimeError("local commit failed")
            kept = writer.put("r0/kept/0", "r0", {"logprobs": np.ones(3, np.float32)})
            writer.flush()
        assert sum(s.stats()["keys"] for s in services) == 1  # nothing of the region leaked
        owner = next(s for s in services if s.name == kept["logprobs"].unit)
        assert owner.unit.lookup([kept["logprobs"].key])


@pytest.mark.slow
def test_back_pressure_with_readers_releasing_as_they_consume():
    synth = SyntheticConfig(**{**SYNTH, "sessions": 8, "tokens_per_step": 200, "layers": 8,
                               "branch_prob": 0.0})
    reference = build_sessions(synth)  # inline only: what the trainer must see
    total = sum(a.nbytes for s in reference for st in s.steps for a in st.arrays.values())
    capacity = total // 3  # the arenas hold about a third of the rollout at once
    with local_units("tcp", units=1, capacity=capacity, put_timeout_s=20.0) as (config, services, clients):
        ready: list = []
        cond = threading.Condition()
        errors: list = []

        class OnlySession:
            """Writes the steps of one session; the replayed earlier sessions stay local."""

            def __init__(self, writer, session_id):
                self.writer, self.session_id = writer, session_id

            def put(self, key, partition, fields):
                if key.split("/")[1] != self.session_id:
                    return None
                return self.writer.put(key, partition, fields)

        def produce():
            try:
                with Writer(clients, config) as writer:
                    for i in range(synth.sessions):
                        one = SyntheticConfig(**{**SYNTH, "sessions": i + 1, "tokens_per_step": 200,
                                                 "layers": 8, "branch_prob": 0.0})
                        target = reference[i].session_id
                        session = build_sessions(one, writer=OnlySession(writer, target), partition="p",
                                                 inline=False)[i:i + 1]
                        writer.flush()
                        with cond:
                            ready.append(session[0])
                            cond.notify()
            except BaseException as exc:  # surfaced by the consumer's assert
                errors.append(exc)
                with cond:
                    cond.notify()

        producer = threading.Thread(target=produce)
        producer.start()
        # Let the producer run into the full arena before anything is consumed.
        wait_until(lambda: services[0].stats()["writers_waiting"] or errors, 20,
                   "the producer waits on the full arena")
        consumed = 0
        with Reader(clients, config) as reader:
            while consumed < synth.sessions and not errors:
                with cond:
                    cond.wait_for(lambda: len(ready) > consumed or errors, timeout=30)
                if errors:
                    break
                session = ready[consumed]
                segments = lineage_segments(session)
                restored = reader.fetch([seg.layouts for seg in segments])
                for seg, got, ref_seg in zip(segments, restored, lineage_segments(reference[consumed])):
                    _assert_same(got, inline_fields(ref_seg))
                reader.release([seg.layouts for seg in segments], "p")
                consumed += 1
        producer.join(30)
        assert not errors, errors
        assert consumed == synth.sessions
        stats = services[0].stats()
        assert stats["keys"] == 0 and stats["used"] == 0
        assert stats["waits"] > 0  # the writer really was held back by a full arena
        assert total > capacity  # the rollout really did not fit at once


def test_full_arena_without_consumer_raises_capacity_error():
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.3) as (config, _, clients):
        with Writer(clients, config) as writer:
            block = np.zeros((600 << 10) // 4, dtype=np.float32)
            writer.put("a", "p", {"logprobs": block})
            writer.flush()
            writer.put("b", "p", {"logprobs": block})
            with pytest.raises(Exception) as info:
                writer.flush()
            assert isinstance(info.value.__cause__, CapacityError)


@pytest.mark.rdma
def test_tcp_client_reads_from_a_unit_serving_rdma():
    from gputq.client.clients import UnitClients

    from .conftest import nixl_usable

    if nixl_usable() is not None:
        pytest.skip(nixl_usable())
    with local_units("rdma", units=1) as (config, services, clients):
        assert services[0].address()["transport"] == "rdma"
        with Writer(clients, config) as writer:
            refs = writer.put("k/0", "p", {"logprobs": np.arange(7, dtype=np.float32)})
            writer.flush()
        with UnitClients(clients.membership, config.replace(transport="tcp")) as tcp_clients:
            assert tcp_clients.transport_of("su-0")[0] == "tcp"
            with Reader(tcp_clients, config) as reader:
                (got,) = reader.fetch([{"logprobs": Layout.from_ref(refs["logprobs"])}])
        assert np.array_equal(got["rollout_log_probs"], np.arange(7, dtype=np.float32))


def test_read_racing_a_release_returns_the_right_bytes(transport_name):
    """A release (and a new write) landing between lease and transfer never leaks other bytes."""
    from gputq.transport import get_transport
    from gputq.unit.storage_unit import StorageUnit

    size = 64 << 10

    class RacingUnit(StorageUnit):
        race = True

        def _pin(self, keys, *args, **kwargs):  # under both lease() and the NIXL server's lease_regions()
            lease = super()._pin(keys, *args, **kwargs)
            if self.race:
                self.race = False
                self.release(keys)  # the key's last reference goes while it is leased
                self.put("intruder", np.full(size, 0xEE, np.uint8), {"partition": "p"}, timeout=1)
            return lease

    original = np.random.default_rng(5).integers(0, 255, size, dtype=np.uint8)
    with RacingUnit("su-race", 3 * size, put_timeout_s=1) as unit:
        unit.put("victim", original, {"partition": "p"})
        server = get_transport(transport_name).serve(unit, host="127.0.0.1", port=0, token="t" * 32,
                                                     limits=ServerLimits(max_frame_bytes=1 << 30))
        try:
            with get_transport(transport_name).connect(server.address, token="t" * 32,
                                                       max_frame_bytes=1 << 30, timeout=10) as channel:
                dest = np.zeros(size, np.uint8)
                assert channel.read(["victim"], dest, timeout=10) == [size]
                assert np.array_equal(dest, original)  # never the intruder's 0xEE
                with pytest.raises(UnknownKeyError, match="victim"):
                    channel.read(["victim"], dest, timeout=10)
        finally:
            server.close()
        assert np.array_equal(unit.read(["intruder"])[0], np.full(size, 0xEE, np.uint8))


def test_shard_with_more_keys_than_one_request_holds():
    """Thousands of keys per unit are read in bounded batches, bit-exact."""
    with local_units("tcp", units=1, capacity=16 << 20) as (config, _, clients):
        n = 9000  # > 2 batches; the key names alone exceed one control frame
        values = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
        with Writer(clients, config) as writer:
            refs = [writer.put(f"rollout-0/session-{i:06d}/step-0000/" + "x" * 100, "p",
                               {"logprobs": values[i]})["logprobs"] for i in range(n)]
            writer.flush()
        layout = Layout.concat([Layout.from_ref(ref) for ref in refs])
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{"logprobs": layout}])
        assert reader.last_stats.unique_keys == n
        assert np.array_equal(got["rollout_log_probs"], values.reshape(-1))


def test_fill_only_field_restores_with_its_own_dtype():
    fill_only = Layout.empty("routed_experts", 3, fill=0, dtype="int32", row_shape=(2, 2))
    with local_units("tcp", units=1) as (config, _, clients), Reader(clients, config) as reader:
        (got,) = reader.fetch([{"routed_experts": fill_only}])
    assert got["rollout_routed_experts"].dtype == np.int32
    assert np.array_equal(got["rollout_routed_experts"], np.zeros((3, 2, 2), np.int32))


def test_segments_own_their_steps_after_finalize():
    """Filtered samples free what only they used; shared steps go with their last segment."""
    synth = SyntheticConfig(**{**SYNTH, "rewrite_prob": 0.0, "branch_prob": 0.0, "sessions": 2})
    with local_units("tcp", units=2) as (config, services, clients):
        with Writer(clients, config) as writer:
            sessions = build_sessions(synth, writer=writer, partition="r0")
            segments = [seg for s in sessions for seg in timeline_segments(s)]
            writer.finalize([seg.layouts for seg in segments], "r0")

        total = sum(s.stats()["keys"] for s in services)
        last = [seg for seg in segments if seg.segment_id.endswith(f"t{len(sessions[0].steps) - 1}")]
        # Timeline segment t_k uses steps 0..k: only the last segment of a session uses its last step.
        filtered, kept = last[:1], [seg for seg in segments if seg is not last[0]]
        with Reader(clients, config) as reader:
            reader.release([seg.layouts for seg in filtered], "r0")  # e.g. a group with identical rewards
            assert sum(s.stats()["keys"] for s in services) == total - 2  # its last step's two fields
            restored = reader.fetch([seg.layouts for seg in kept])  # everything kept is still there
            for seg, got in zip(kept, restored):
                _assert_same(got, inline_fields(seg))
            half = len(kept) // 2
            reader.release([seg.layouts for seg in kept[:half]], "r0")  # rank 0 done
            reader.fetch([seg.layouts for seg in kept[half:]])  # rank 1 still reads its shared prefixes
            reader.release([seg.layouts for seg in kept[half:]], "r0")
        assert sum(s.stats()["keys"] for s in services) == 0
        assert sum(s.stats()["used"] for s in services) == 0
