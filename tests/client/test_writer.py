"""Writer edge cases: ownership of the caller's buffers, failures, timeouts, empty fields."""

from __future__ import annotations

import logging
import sys
import threading

import numpy as np
import pytest

import gputq.errors

from gputq.client.clients import UnitClients
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout, uses_by_unit
from gputq.errors import (
    CapacityError,
    DuplicateKeyError,
    GputqTimeoutError,
    InvalidInputError,
    PartialFailureError,
    TransferError,
    UnknownKeyError,
)
from tests.conftest import local_units


def test_caller_may_reuse_its_buffer_right_after_put():
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            buf = np.linspace(-5, 0, 1 << 18, dtype=np.float32)  # already the stored dtype: no copy needed
            expected = buf.copy()
            refs = writer.put("k/0", "p", {"logprobs": buf})
            buf[:] = -1.0  # an engine reusing its output buffer
            writer.flush()
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{"logprobs": Layout.from_ref(refs["logprobs"])}])
        assert np.array_equal(got["rollout_log_probs"], expected)


def test_zero_row_fields_round_trip():
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            refs = writer.put("k/0", "p", {"routed_experts": np.zeros((0, 4, 2), np.int32),
                                           "logprobs": np.zeros(0, np.float32)})
            writer.flush()
        with Reader(clients, config) as reader:
            (got,) = reader.fetch([{f: Layout.from_ref(r) for f, r in refs.items()}])
        assert got["rollout_routed_experts"].shape == (0, 4, 2)
        assert got["rollout_log_probs"].shape == (0,)


def test_close_reports_failures_that_flush_never_saw():
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.2) as (config, _, clients):
        writer = Writer(clients, config)
        writer.put("first", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
        writer.flush()
        writer.put("no-room", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})  # the arena stays full
        with pytest.raises(CapacityError, match="no-room"):
            writer.close()
        writer.close()  # idempotent, reported once


def test_a_full_unit_costs_one_wait_not_one_per_queued_step_and_takes_writes_again_once_freed():
    """Only the writes in flight when the unit filled wait for space; the ones queued behind them are refused at
    once while the unit is still full, and a write after a release lands."""
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.5) as (config, services, clients):
        with Writer(clients, config) as writer:
            writer.put("first", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
            writer.flush()
            for i in range(5):
                writer.put(f"no-room/{i}", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
            with pytest.raises(CapacityError) as info:
                writer.flush()
            assert sorted(info.value.keys) == [f"no-room/{i}/logprobs" for i in range(5)]
            stats = services[0].stats()
            # Writes already in flight on the sender threads each wait; none queued behind them does.
            assert stats["waits"] == stats["capacity_errors"] <= config.writer_threads < 5
            assert stats["keys"] == 1
            clients.channel(services[0].name).call("release_partition", timeout=5, partition="p")
            writer.put("after", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
            writer.flush()
        assert services[0].stats()["keys"] == 1


@pytest.fixture(params=["3.11 notes", "3.10 notes"])
def notes(request, monkeypatch, caplog):
    """Each test twice: with exceptions' own notes, and as on Python 3.10, which has none (kept and logged).
    Yields the log records of the notes gputq logged."""
    native = request.param == "3.11 notes"
    if native and sys.version_info < (3, 11):
        pytest.skip("exceptions take notes themselves from Python 3.11 on")
    monkeypatch.setattr(gputq.errors, "_NATIVE_NOTES", native)
    with caplog.at_level(logging.WARNING, logger="gputq"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "gputq"]
    if native:
        assert not any(r.name == "gputq" for r in caplog.records)


def _noted(exc: BaseException, words: str, logged: list) -> bool:
    """Whether ``exc`` carries a note with ``words``, logged too where exceptions take no notes."""
    noted = [note for note in getattr(exc, "__notes__", ()) if words in note]
    return len(noted) == 1 and (gputq.errors._NATIVE_NOTES or logged == [f"{type(exc).__name__}: {noted[0]}"])


def test_exit_keeps_the_callers_exception_and_notes_failed_writes(notes):
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.2) as (config, _, clients):
        with pytest.raises(KeyError) as info:
            with Writer(clients, config) as writer:
                writer.put("first", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
                writer.flush()
                writer.put("no-room", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
                raise KeyError("local failure")
        assert _noted(info.value, "writes also failed", notes())


def _refusing_deletes(monkeypatch, unit) -> None:
    original = unit.control

    def refusing(method, args=None):
        if method == "delete":
            raise InvalidInputError("delete: refused")
        return original(method, args)
    monkeypatch.setattr(unit, "control", refusing)


def test_a_commit_region_whose_rollback_fails_keeps_the_callers_exception_and_notes_it(notes, monkeypatch):
    with local_units("tcp", units=1) as (config, services, clients):
        with Writer(clients, config) as writer:
            with pytest.raises(RuntimeError, match="local commit failed") as info:
                with writer.commit_region() as region:
                    region.put("r/0", "r", {"logprobs": np.zeros(5, np.float32)})
                    writer.flush()
                    _refusing_deletes(monkeypatch, services[0].unit)
                    raise RuntimeError("local commit failed")
        assert _noted(info.value, "rolling back 1 keys also failed: ", notes())
        assert "delete: refused" in info.value.__notes__[0]


def test_a_half_stored_step_whose_undo_fails_raises_its_own_error_and_notes_the_keys_left(notes, monkeypatch):
    """The second field finds its key taken; deleting the first, which landed, is refused: the step's error
    names the keys that could not be deleted."""
    with local_units("tcp", units=1) as (config, services, clients):
        with Writer(clients, config) as writer:
            writer.put("d", "p", {"logprobs": np.zeros(4, np.float32)})
            writer.flush()
            _refusing_deletes(monkeypatch, services[0].unit)
            with pytest.raises(DuplicateKeyError) as info:
                writer.put("d", "p", {"routed_experts": np.ones((4, 2, 2), np.int32),
                                      "logprobs": np.zeros(4, np.float32)})
                writer.flush()
        assert _noted(info.value, "deleting the step's stored keys ['d/routed_experts'] from unit su-0 failed",
                      notes())
        assert services[0].stats()["keys"] == 2


def test_wait_and_flush_time_out_typed():
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            gate = threading.Event()
            original = writer._sends._send_batch

            def slow_send(*args):
                gate.wait(5)
                return original(*args)

            writer._sends._send_batch = slow_send
            writer.put("slow", "p", {"logprobs": np.ones(4, np.float32)})
            with pytest.raises(GputqTimeoutError, match="slow"):
                writer.wait(["slow/logprobs"], timeout=0.1)
            with pytest.raises(TimeoutError):
                writer.flush(timeout=0.1)
            gate.set()
            writer.flush(timeout=5)


def _with_incarnations(clients, config):
    """Clients whose membership carries each unit's incarnation (a made-up one where units publish none)."""
    membership = {unit: {"incarnation": f"{i:016x}", **address}
                  for i, (unit, address) in enumerate(sorted(clients.membership.items()))}
    return UnitClients(membership, config)


def _put_steps(writer, count: int, first: int = 0) -> list:
    """Steps ``s<first> ..`` of partition ``p`` whose R3 and logprobs hold their index."""
    return [writer.put(f"s{i}", "p", {"routed_experts": np.full((4, 2, 2), i, np.int32),
                                      "logprobs": np.full(4, -i, np.float32)}) for i in range(first, first + count)]


def test_refs_carry_a_fresh_generation_and_the_units_incarnation():
    with local_units("tcp", units=2) as (config, _, base), _with_incarnations(base, config) as clients:
        metas = []
        for unit in clients.units:
            channel = clients.channel(unit)
            original = channel.write_many

            def spy(items, timeout=None, _original=original):
                metas.extend((key, dict(meta)) for key, _, meta in items)
                return _original(items, timeout=timeout)

            channel.write_many = spy
        with Writer(clients, config) as writer:
            refs = _put_steps(writer, 20)
            writer.flush()
        by_key = {r.key: r for ref in refs for r in ref.values()}
        membership = clients.membership
        assert all(r.incarnation == membership[r.unit]["incarnation"] for r in by_key.values())
        generations = [r.generation for r in by_key.values()]
        assert all(1 <= g < 2**63 for g in generations) and len(set(generations)) == len(generations)
        assert len(metas) == len(by_key) == 40  # one write per stored key
        assert {key: meta["generation"] for key, meta in metas} == {k: r.generation for k, r in by_key.items()}
        with Reader(clients, config) as reader:
            got = reader.fetch([{f: Layout.from_ref(r) for f, r in ref.items()} for ref in refs])
        assert [int(g["rollout_routed_experts"][0, 0, 0]) for g in got] == list(range(20))


class _LiveOnly:
    """Clients that report one unit lost: the writer must place keys on the others."""

    def __init__(self, clients, lost):
        self._clients, self._lost = clients, lost

    def __getattr__(self, name):
        return getattr(self._clients, name)

    @property
    def live_units(self):
        return [u for u in self._clients.units if u != self._lost]


def test_keys_are_placed_on_live_units_only():
    with local_units("tcp", units=3) as (config, services, clients):
        with Writer(_LiveOnly(clients, "su-1"), config) as writer:
            refs = [writer.put(f"s{i}", "p", {"logprobs": np.full(4, -i, np.float32)}) for i in range(60)]
            writer.flush()
        assert {r["logprobs"].unit for r in refs} == {"su-0", "su-2"}
        assert services[1].stats()["puts"] == 0


@pytest.mark.parametrize("change,message", [
    ({"generation": 12345}, "stored s/logprobs as generation 12345, not the writer's"),
    ({"incarnation": "ffffffffffffffff"}, "restarted: s/logprobs landed in incarnation ffffffffffffffff"),
])
def test_a_write_stored_under_another_version_fails(change, message):
    with local_units("tcp", units=1) as (config, _, base), _with_incarnations(base, config) as clients:
        channel = clients.channel("su-0")
        original = channel.write_many

        def other_version(items, timeout=None):
            receipts = original(items, timeout=timeout)
            return [receipt | {"incarnation": clients.membership["su-0"]["incarnation"],
                               "generation": meta["generation"]} | change
                    for receipt, (_, _, meta) in zip(receipts, items)]

        channel.write_many = other_version
        with Writer(clients, config) as writer:
            writer.put("s", "p", {"logprobs": np.ones(4, np.float32)})
            with pytest.raises(TransferError, match=message) as info:
                writer.flush()
        assert info.value.keys == ("s/logprobs",)


def _holders(service, keys) -> dict:
    return {entry["key"]: entry["holders"] for entry in service.unit.lookup(sorted(keys))}


@pytest.mark.timeout(60)
def test_finalize_serves_every_reachable_unit_and_names_the_lost_one():
    with local_units("tcp", units=3, capacity=1 << 20) as (config, services, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"logprobs": np.full(4, i, np.float32)})["logprobs"]
                    for i in range(30)]
            writer.flush()
            shard = [{"logprobs": Layout.from_ref(ref)} for ref in refs]
            uses = uses_by_unit(shard)
            assert len(uses) == 3  # every unit holds some of the shard
            lost = next(iter(uses))  # the first unit served: one at a time, the rest waited behind it
            by_name = {service.name: service for service in services}
            by_name[lost].close()
            with pytest.raises(PartialFailureError, match=f"unreachable: {lost}: unit {lost} is lost") as info:
                writer.finalize(shard + shard, "p")  # two segments use every step
        others = [unit for unit in uses if unit != lost]
        assert info.value.result == {"finalized": sum(len(uses[u]) for u in others),
                                     "unreachable": {lost: info.value.result["unreachable"][lost]}}
        assert set(clients.lost) == {lost}
        for unit in others:  # the write reference became two segment references
            assert _holders(by_name[unit], uses[unit]) == {key: {"p": 2} for key in uses[unit]}


@pytest.mark.timeout(60)
def test_finalize_raises_a_units_own_answer_after_the_others_finalized():
    with local_units("tcp", units=2, capacity=1 << 20) as (config, services, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}", "p", {"logprobs": np.full(4, i, np.float32)})["logprobs"]
                    for i in range(20)]
            writer.flush()
            shard = [{"logprobs": Layout.from_ref(ref)} for ref in refs]
            uses = uses_by_unit(shard)
            gone, kept = list(uses)
            by_name = {service.name: service for service in services}
            by_name[gone].unit.release_partition("p")  # its keys are gone
            with pytest.raises(UnknownKeyError):
                writer.finalize(shard, "p")
        assert _holders(by_name[kept], uses[kept]) == {key: {"p": 1} for key in uses[kept]}
        assert clients.lost == {}


def test_steps_queued_behind_a_send_go_in_one_request_and_a_failed_one_is_undone_alone():
    """Puts made while a request is on the wire are sent together; a step of that batch whose field the unit
    refuses is deleted whole, and its neighbours in the request are stored."""
    with local_units("tcp", units=1, writer_threads=1) as (config, services, clients):
        channel = clients.channel(services[0].name)
        channel.write("s1/logprobs", np.zeros(4, np.float32).tobytes(), {"partition": "p"}, timeout=5)
        original, on_wire, gate, batches = channel.write_many, threading.Event(), threading.Event(), []

        def gated(items, timeout=None):
            batches.append([key for key, _, _ in items])
            on_wire.set()
            gate.wait(10)  # the first request holds the single sender while the next puts queue
            return original(items, timeout=timeout)

        channel.write_many = gated
        with Writer(clients, config) as writer:
            refs = _put_steps(writer, 1)
            assert on_wire.wait(10)  # s0's request is on the wire before the next puts
            refs += _put_steps(writer, 3, first=1)
            gate.set()
            with pytest.raises(DuplicateKeyError) as info:
                writer.flush(timeout=10)
        assert info.value.keys == ("s1/logprobs", "s1/routed_experts")
        assert batches == [["s0/routed_experts", "s0/logprobs"],
                           [f"s{i}/{f}" for i in (1, 2, 3) for f in ("routed_experts", "logprobs")]]
        assert services[0].stats()["keys"] == 7  # s0, s2, s3 and the s1/logprobs stored before
        with pytest.raises(UnknownKeyError):  # s1's field that landed was deleted
            services[0].unit.lookup(["s1/routed_experts"])
        with Reader(clients, config) as reader:
            got = reader.fetch([{f: Layout.from_ref(r) for f, r in refs[i].items()} for i in (0, 2, 3)])
        assert [int(g["rollout_routed_experts"][0, 0, 0]) for g in got] == [0, 2, 3]


def test_a_batch_to_a_unit_marked_full_is_sent_when_its_largest_field_fits():
    """Once the unit has room again, the check before a batch asks that each field fit, as each did when sent
    alone: not the batch's total, which needs no single block."""
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.2, writer_threads=1) as (config, services,
                                                                                               clients):
        with Writer(clients, config) as writer:
            writer.put("first", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
            writer.flush()
            writer.put("no-room", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
            with pytest.raises(CapacityError):
                writer.flush()  # the unit is marked full
            clients.channel(services[0].name).call("release_partition", timeout=5, partition="p")
            gate = threading.Event()
            writer._sends._pool.submit(gate.wait, 10)  # the single sender waits while three steps queue
            for i in range(3):
                writer.put(f"s{i}", "q", {"logprobs": np.full((400 << 10) // 4, i, np.float32)})
            gate.set()
            with pytest.raises(CapacityError) as info:
                writer.flush(timeout=10)
        assert info.value.keys == ("s2/logprobs",)  # 1.2 MiB in all, but two of them fit: they landed
        assert services[0].stats()["keys"] == 2
