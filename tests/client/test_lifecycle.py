"""Lifetimes of stored steps: carry across rollouts, drop, invariants, and a model-based property test."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputq.client.lifecycle import carry, drop, uses_of
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.cluster.controller import Controller
from gputq.data.fields import FieldRegistry
from gputq.data.refs import Layout
from gputq.data.trajectory import Session, inline_fields, timeline_segments
from gputq.errors import InvalidInputError, PartialFailureError, UnknownKeyError
from gputq.tools.scenarios import overlapping_rollouts
from tests.conftest import local_units

L, K = 2, 3


def _controller(config, services) -> Controller:
    controller = Controller(config, heartbeat=False)
    for service in services:
        controller.register_unit(service.name, service.address())
    return controller


def _step(session: Session, writer: Writer, partition: str, rng: np.random.Generator, n_out: int = 5):
    """Append one model call to ``session``, its fields stored in ``partition``."""
    prompt = np.concatenate([session.context, rng.integers(0, 1000, 3 if session.steps else 6, dtype=np.int32)])
    start = session.steps[-1].seqlen - 1 if session.steps else 0
    arrays = {"logprobs": -rng.random(n_out, dtype=np.float32),
              "routed_experts": rng.integers(0, 64, (len(prompt) + n_out - 1 - start, L, K), dtype=np.int32)}
    key = f"{partition}/{session.session_id}/{len(session.steps)}"
    return session.append_step(prompt, rng.integers(0, 1000, n_out, dtype=np.int32), arrays=arrays,
                               refs=writer.put(key, partition, arrays))


def _offsets(clients, session: Session) -> dict:
    out = {}
    for step in session.steps:
        for ref in step.refs.values():
            (entry,) = clients.channel(ref.unit).call("lookup", keys=[ref.key])
            out[ref.key] = (ref.unit, entry["offset"])
    return out


def _assert_restores(reader: Reader, segments) -> None:
    for seg, got in zip(segments, reader.fetch([seg.layouts for seg in segments])):
        for name, want in inline_fields(seg).items():
            assert got[name].dtype == want.dtype and np.array_equal(got[name], want), (seg.segment_id, name)


def test_a_session_carried_across_three_rollouts_keeps_its_steps_without_moving_bytes():
    rng = np.random.default_rng(3)
    with local_units("tcp", units=2) as (config, services, clients):
        controller = _controller(config, services)
        session = Session.create("s", FieldRegistry.builtin(L, K))
        with Writer(clients, config) as writer, Reader(clients, config) as reader:
            for i, partition in enumerate(("r0", "r1", "r2")):
                controller.open_partition(partition)
                if i:  # the unfinished session goes on in the next rollout
                    before = _offsets(clients, session)
                    assert carry(session, f"r{i - 1}", partition, clients) == 2 * len(session.steps)
                    writer.flush()
                    assert _offsets(clients, session) == before  # same units, same arena offsets
                    assert controller.release_partition(f"r{i - 1}") == {"freed": 0, "unreachable": {}}
                for _ in range(2):
                    _step(session, writer, partition, rng)
                writer.flush()
                assert controller.check_invariants([session])["ok"]
            segments = timeline_segments(session)  # six steps, one context: prefixes are shared
            writer.finalize([seg.layouts for seg in segments], "r2")
            report = controller.check_invariants(segments)
            assert report["ok"] and report["keys_checked"] == 12, report
            _assert_restores(reader, segments)
            reader.release([seg.layouts for seg in segments], "r2")
        assert controller.release_partition("r2") == {"freed": 0, "unreachable": {}}
        assert sum(s.stats()["used"] for s in services) == 0
        assert controller.check_invariants()["ok"]
        controller.close()


def test_drop_frees_only_what_no_other_live_layout_uses():
    rng = np.random.default_rng(4)
    with local_units("tcp", units=2) as (config, services, clients):
        controller = _controller(config, services)
        controller.open_partition("r0")
        session = Session.create("s", FieldRegistry.builtin(L, K))
        with Writer(clients, config) as writer, Reader(clients, config) as reader:
            for _ in range(3):
                _step(session, writer, "r0", rng)
            t0, t1, t2 = segments = timeline_segments(session)
            writer.finalize([seg.layouts for seg in segments], "r0")
            # t2 alone uses step 2 (both fields); steps 0 and 1 stay for t0 and t1.
            assert drop([t2.layouts], "r0", clients) == 2
            assert controller.check_invariants([t0, t1])["ok"]
            with pytest.raises(UnknownKeyError, match="r0/s/2/"):
                drop([t2.layouts], "r0", clients)  # strict: a second drop is refused, nothing changes
            assert controller.check_invariants([t0, t1])["ok"]
            with pytest.raises(InvalidInputError, match="holds 1 reference"):
                drop([t1.layouts, t1.layouts], "r0", clients)  # more uses than t1 was given
            _assert_restores(reader, [t0, t1])
            assert drop([t1.layouts], "r0", clients) == 2  # step 1's fields; step 0's experts stay for t0
            assert drop([t0.layouts], "r0", clients) == 2
        assert sum(s.stats()["keys"] for s in services) == 0
        controller.close()


@pytest.mark.timeout(60)
def test_carry_transfer_and_drop_finish_on_the_reachable_units_and_name_the_lost_one():
    """One fan-out behind carry and Controller.transfer, one behind drop and Reader.release."""
    with local_units("tcp", units=3, capacity=1 << 20) as (config, services, clients):
        controller = _controller(config, services)
        with Writer(clients, config) as writer:
            refs = [writer.put(f"r0/s{i}/0", "r0", {"logprobs": np.full(4, i, np.float32)})["logprobs"]
                    for i in range(30)]
            writer.flush()
        on = {s.name: [ref for ref in refs if ref.unit == s.name] for s in services}
        assert all(on.values())
        services[0].close()
        with pytest.raises(PartialFailureError, match="transfer 'r0' -> 'r1'.*unreachable: su-0") as info:
            carry(refs[:20], "r0", "r1", clients)
        carried = [ref for ref in refs[:20] if ref.unit != "su-0"]
        assert info.value.result == {"moved": len(carried), "unreachable": {"su-0": info.value.result[
            "unreachable"]["su-0"]}} and "unit su-0 is lost" in info.value.result["unreachable"]["su-0"]
        by_unit = {}
        for ref in refs[20:]:
            by_unit.setdefault(ref.unit, []).extend([ref.key, ref.key])  # repeats count once
        with pytest.raises(PartialFailureError, match="su-0") as info:
            controller.transfer(by_unit, "r0", "r2")
        assert info.value.result["moved"] == sum(ref.unit != "su-0" for ref in refs[20:])
        assert controller.partitions() == ["r2"]
        samples = [{"logprobs": Layout.from_ref(ref)} for ref in carried]
        with pytest.raises(PartialFailureError, match="drop from 'r1'") as info:
            drop(samples + [{"logprobs": Layout.from_ref(on["su-0"][0])}], "r1", clients)
        assert info.value.result == {"freed": len(carried), "unreachable": {"su-0": info.value.result[
            "unreachable"]["su-0"]}}
        assert sum(s.stats()["keys"] for s in services[1:]) == sum(ref.unit != "su-0" for ref in refs[20:])
        controller.close()


def test_check_invariants_names_unowned_and_missing_keys():
    rng = np.random.default_rng(5)
    with local_units("tcp", units=1) as (config, services, clients):
        controller = _controller(config, services)
        controller.open_partition("live")
        with Writer(clients, config) as writer:
            kept = Session.create("kept", FieldRegistry.builtin(L, K))
            stray = Session.create("stray", FieldRegistry.builtin(L, K))
            _step(kept, writer, "live", rng)
            _step(stray, writer, "never-opened", rng)
            writer.flush()
            (violation,) = controller.check_invariants([kept])["violations"]
            assert violation.startswith("unit su-0 stores 2 keys") and "partition 'never-opened'" in violation
            writer.delete(list(kept.steps[0].refs.values()))
            report = controller.check_invariants([kept])
            assert not report["ok"]
            missing = [v for v in report["violations"] if "referenced 1 times but not stored" in v]
            assert sorted(missing) == sorted(f"key {r.key!r} on unit su-0 is referenced 1 times but not stored"
                                             for r in kept.steps[0].refs.values())
        controller.close()


@pytest.mark.timeout(120)
def test_two_overlapping_rollouts_end_with_an_empty_arena():
    with local_units("tcp", units=2, routed_experts_dtype="uint8") as (config, services, clients):
        controller = _controller(config, services)
        summary = overlapping_rollouts(controller, clients, config, sessions=5, steps=3, tokens=24, seed=1)
        assert summary["verified"], summary
        assert summary["sessions_carried"] >= 1 and summary["segments_dropped"] >= 1
        assert summary["keys_carried"] > 0 and summary["keys_freed_by_drop"] > 0
        assert summary["released_0"]["freed"] == 0  # consumed and dropped: nothing left; carried: moved
        assert [c["ok"] for c in summary["invariants"]] == [True, True]
        assert sum(s.stats()["used"] for s in services) == 0
        controller.close()


def test_uses_of_counts_segment_uses_and_write_references_once():
    rng = np.random.default_rng(6)
    with local_units("tcp", units=1) as (config, services, clients):
        with Writer(clients, config) as writer:
            session = Session.create("s", FieldRegistry.builtin(L, K))
            for _ in range(2):
                _step(session, writer, "p", rng)
            writer.flush()
        t0, t1 = timeline_segments(session)
        uses = uses_of([t0, t1])
        step0 = {r.key for r in session.steps[0].refs.values()}
        assert {key: n for (_, key), n in uses.items() if key in step0} == {
            "p/s/0/routed_experts": 2, "p/s/0/logprobs": 1}
        assert uses_of([session, session]) == Counter({("su-0", r.key): 1 for s in session.steps
                                                      for r in s.refs.values()})
        with pytest.raises(InvalidInputError):
            uses_of([42])


# -- the property test: random lifecycles against a reference model -------------------------

OPS = ("put", "compose", "carry", "drop", "consume", "release")
# Drawn with these weights: a segment must be put and composed before it can be dropped or consumed.
_WEIGHTED = ("put",) * 4 + ("compose",) * 2 + ("carry",) + ("drop",) * 3 + ("consume",) * 3 + ("release",)
_examples = itertools.count()


@dataclass
class _Sess:
    sid: str
    partition: str
    steps: list = field(default_factory=list)       # FieldRef per step (logprobs)
    segments: dict = field(default_factory=dict)    # segment id -> step indices, live ones
    composed: bool = False


class _Model:
    """What must be stored: per key, its references per partition."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.partitions: list[str] = []  # every partition opened, in order
        self.live: list[str] = []        # those not released yet
        self.sessions: list[_Sess] = []
        self.session_ids = itertools.count()
        self.holders: dict[str, Counter] = {}
        self.data: dict[str, np.ndarray] = {}
        self.refs: dict = {}

    def new_partition(self, controller) -> str:
        name = f"{self.prefix}-r{len(self.partitions)}"
        self.partitions.append(name)
        self.live.append(name)
        controller.open_partition(name)
        return name

    def drop_refs(self, keys: Counter, partition: str) -> int:
        freed = 0
        for key, n in keys.items():
            self.holders[key][partition] -= n
            self.holders[key] = +self.holders[key]
            if not self.holders[key]:
                del self.holders[key]
                freed += 1
        return freed

    def layouts(self, sess: _Sess, seg: str) -> dict:
        return {"logprobs": Layout.concat(Layout.from_ref(sess.steps[i]) for i in sess.segments[seg])}

    def referenced(self) -> list:
        out = []
        for sess in self.sessions:
            used = {i for idx in sess.segments.values() for i in idx}
            out += [self.layouts(sess, seg) for seg in sess.segments]
            out += [ref for i, ref in enumerate(sess.steps) if ref.key in self.holders and
                    (not sess.composed or i not in used)]
        return out


def _apply(op: str, a: int, b: int, c: int, model: _Model, env) -> None:
    config, clients, controller, writer = env
    open_sessions = [s for s in model.sessions if not s.composed]
    composed = [s for s in model.sessions if s.segments]
    if op == "put":
        if not open_sessions or a % 6 == 0:
            partition = model.live[-1] if model.live else model.new_partition(controller)
            sess = _Sess(f"{model.prefix}-s{next(model.session_ids)}", partition)
            model.sessions.append(sess)
        else:
            sess = open_sessions[a % len(open_sessions)]
        rng = np.random.default_rng(c)
        for _ in range(1 + b % 4):  # a few model calls of the session
            array = rng.standard_normal(int(rng.integers(1, 48))).astype(np.float32)
            ref = writer.put(f"{sess.sid}/{len(sess.steps)}", sess.partition, {"logprobs": array})["logprobs"]
            sess.steps.append(ref)
            model.holders[ref.key] = Counter({sess.partition: 1})
            model.data[ref.key] = array
        writer.flush()
    elif op == "compose" and any(s.steps for s in open_sessions):
        sess = [s for s in open_sessions if s.steps][a % len([s for s in open_sessions if s.steps])]
        rng = np.random.default_rng(b)
        for j in range(1 + c % 3):
            picked = [i for i in range(len(sess.steps)) if rng.random() < 0.6]
            sess.segments[f"g{j}"] = picked or [int(rng.integers(0, len(sess.steps)))]
        samples = [model.layouts(sess, seg) for seg in sess.segments]
        writer.finalize(samples, sess.partition)
        uses = Counter(i for idx in sess.segments.values() for i in idx)
        for i, n in uses.items():
            model.holders[sess.steps[i].key][sess.partition] += n
        model.drop_refs(Counter({sess.steps[i].key: 1 for i in uses}), sess.partition)
        sess.composed = True
    elif op == "carry" and model.sessions:
        sess = model.sessions[a % len(model.sessions)]
        alive = [ref for ref in sess.steps if ref.key in model.holders]
        later = [p for p in model.live if model.partitions.index(p) > model.partitions.index(sess.partition)]
        target = later[b % len(later)] if later and b % 3 else model.new_partition(controller)
        moved = carry(alive, sess.partition, target, clients) if alive else 0
        assert moved == len(alive)
        for ref in alive:
            model.holders[ref.key][target] += model.holders[ref.key].pop(sess.partition)
        sess.partition = target
    elif op in ("drop", "consume") and composed:
        sess = composed[a % len(composed)]
        seg = sorted(sess.segments)[b % len(sess.segments)]
        sample = model.layouts(sess, seg)
        if op == "drop":
            freed = drop([sample], sess.partition, clients)
        else:
            with Reader(clients, config) as reader:
                (got,) = reader.fetch([sample])
                want = np.concatenate([model.data[sess.steps[i].key] for i in sess.segments[seg]])
                assert np.array_equal(got["rollout_log_probs"], want)
                reader.release([sample], sess.partition)
            freed = None
        model_freed = model.drop_refs(Counter({sess.steps[i].key: 1 for i in set(sess.segments[seg])}),
                                      sess.partition)
        assert freed in (None, model_freed)
        del sess.segments[seg]
    elif op == "release" and model.live:
        partition = model.live.pop(a % len(model.live))
        result = controller.release_partition(partition)
        held = [key for key, h in model.holders.items() if partition in h]
        assert result == {"freed": model.drop_refs(Counter({k: model.holders[k][partition] for k in held}),
                                                   partition), "unreachable": {}}
        model.sessions = [s for s in model.sessions if s.partition != partition]


def _check_model(model: _Model, clients) -> None:
    by_unit: dict = {}
    for sess in model.sessions:
        for ref in sess.steps:
            if ref.key in model.holders:
                by_unit.setdefault(ref.unit, []).append(ref.key)
    for unit in clients.units:
        keys = sorted(by_unit.get(unit, []))
        stored = {e["key"]: Counter(e["holders"]) for e in clients.channel(unit).call("lookup", keys=keys)}
        assert stored == {key: model.holders[key] for key in keys}
        partitions = clients.channel(unit).call("stats")["partitions"]
        assert sum(p["keys"] for name, p in partitions.items() if name.startswith(model.prefix + "-")) == len(keys)


@pytest.fixture(scope="module")
def lifecycle_env():
    with local_units("tcp", units=2, capacity=16 << 20) as (config, services, clients):
        controller = _controller(config, services)
        with Writer(clients, config) as writer:
            yield config, clients, controller, writer
        controller.close()


def _run_lifecycle(ops, env, check_every_op: bool) -> None:
    config, clients, controller, writer = env
    model = _Model(f"ex{next(_examples)}")
    try:
        for op in ops:
            _apply(*op, model, env)
            _check_model(model, clients)
            if check_every_op:
                report = controller.check_invariants(model.referenced())
                assert report["violations"] == [], report
        assert controller.check_invariants(model.referenced())["violations"] == []
    finally:
        for partition in model.live:
            controller.release_partition(partition)
    model.holders.clear()
    model.sessions.clear()
    _check_model(model, clients)


_op = st.tuples(st.sampled_from(_WEIGHTED), st.integers(0, 2 ** 16), st.integers(0, 2 ** 16), st.integers(0, 2 ** 16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=25))
def test_random_lifecycles_match_the_reference_model(lifecycle_env, ops):
    _run_lifecycle(ops, lifecycle_env, check_every_op=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=50))
def test_random_lifecycles_match_the_reference_model_long(lifecycle_env, ops):
    _run_lifecycle(ops, lifecycle_env, check_every_op=True)


def test_check_invariants_with_the_units_keys_call(monkeypatch):
    """The ``keys`` branch: a stand-in for the unit's own call where this unit lacks it."""
    import gputq.unit.storage_unit as su

    rng = np.random.default_rng(7)
    with local_units("tcp", units=2) as (config, services, clients):
        if "keys" not in su.CONTROL_METHODS:
            monkeypatch.setattr(su, "CONTROL_METHODS", su.CONTROL_METHODS | {"keys"})
            for service in services:
                unit = service.unit

                def keys(unit=unit):
                    with unit._cond:
                        return {p: {k: unit._table[k].holders[p] for k in ks} for p, ks in unit._partitions.items()}

                unit.keys = keys
        controller = _controller(config, services)
        controller.open_partition("live")
        with Writer(clients, config) as writer:
            kept = Session.create("kept", FieldRegistry.builtin(L, K))
            for _ in range(3):
                _step(kept, writer, "live", rng)
            stray = Session.create("stray", FieldRegistry.builtin(L, K))
            _step(stray, writer, "gone", rng)
            writer.flush()
            segments = timeline_segments(kept)
            writer.finalize([seg.layouts for seg in segments], "live")
            report = controller.check_invariants(segments)
            assert report["method"] == "keys" and report["keys_checked"] == 8
            stray_units = sorted({r.unit for r in stray.steps[0].refs.values()})
            assert sorted(v.split()[1] for v in report["violations"]) == stray_units
            assert all("partition 'gone', which is not live" in v for v in report["violations"])
            assert controller.release_partition("gone")["freed"] == 2
            assert controller.check_invariants(segments)["ok"]
            # One use more than the references held: the segment counts must match the table.
            report = controller.check_invariants(segments + [segments[-1]])
            assert not report["ok"] and all("references for" in v for v in report["violations"])
        controller.close()
