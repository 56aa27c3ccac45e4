import json

import numpy as np
import pytest

from gputq.data.canonical import canonicalize
from gputq.data.fields import FieldRegistry
from gputq.data.refs import FieldRef
from gputq.data.trajectory import (
    Segment,
    Session,
    inline_fields,
    lineage_segments,
    materialize_layouts,
    timeline_segments,
)
from gputq.errors import FieldValueError, InvalidInputError, LayoutError
from gputq.tools.synthetic import SyntheticConfig, build_sessions

L, K = 2, 3


class MemWriter:
    """A fake offload writer: canonicalises and keeps blobs in a dict."""

    def __init__(self, fields: FieldRegistry):
        self.fields = fields
        self.blobs: dict[tuple[str, str], np.ndarray] = {}

    def put(self, key, partition, fields):
        refs = {}
        for name, array in fields.items():
            compact = canonicalize(key, self.fields.get(name), array)
            ref = FieldRef(f"{key}/{name}", name, "mem0", compact.shape[0], compact.dtype.name,
                           compact.shape[1:], partition)
            self.blobs[(ref.unit, ref.key)] = compact
            refs[name] = ref
        return refs

    def lookup(self, ref):
        return self.blobs[(ref.unit, ref.key)]


def fields_for(step_rows, n_out, seed):
    rng = np.random.default_rng(seed)
    return {"logprobs": -rng.random(n_out, dtype=np.float32),
            "routed_experts": rng.integers(0, 8, (step_rows, L, K), dtype=np.int32)}


def test_session_steps_and_segments_by_hand():
    reg = FieldRegistry.builtin(L, K)
    s = Session.create("s", reg)
    f0 = fields_for(4, 2, 0)  # prompt 3 + out 2: positions [0, 4)
    st0 = s.append_step([1, 2, 3], [4, 5], arrays=f0)
    assert (st0.prompt_len, st0.n_out, st0.seqlen, st0.start, st0.parent) == (3, 2, 5, 0, None)
    f1 = fields_for(3, 1, 1)  # prompt 7 (2 tool tokens) + out 1: positions [4, 7)
    st1 = s.append_step([1, 2, 3, 4, 5, 6, 7], [8], arrays=f1)
    assert (st1.prompt_len, st1.start, st1.parent) == (7, 4, st0)
    assert np.array_equal(st1.added_ids, [6, 7]) and np.array_equal(st1.context_tokens(), np.arange(1, 9))

    t0, t1 = timeline_segments(s)
    assert (t0.segment_id, len(t0.tokens), t0.prompt_len, t0.response_len) == ("s/t0", 5, 3, 2)
    assert (t1.segment_id, len(t1.tokens), t1.prompt_len, t1.response_len) == ("s/t1", 8, 7, 1)
    out1 = inline_fields(t1)
    assert np.array_equal(out1["rollout_log_probs"], f1["logprobs"])
    assert np.array_equal(out1["rollout_routed_experts"], np.concatenate([f0["routed_experts"], f1["routed_experts"]]))

    (lin,) = lineage_segments(s)
    assert (lin.segment_id, len(lin.tokens), lin.prompt_len, lin.response_len) == ("s/l0", 8, 3, 5)
    out = inline_fields(lin)
    expected_lp = np.concatenate([f0["logprobs"], [0.0, 0.0], f1["logprobs"]]).astype(np.float32)
    assert out["rollout_log_probs"].dtype == np.float32 and np.array_equal(out["rollout_log_probs"], expected_lp)
    assert out["rollout_routed_experts"].shape == (7, L, K)
    assert lin.layouts == {}  # inline only: nothing to lay out


def test_append_step_validation():
    reg = FieldRegistry.builtin(L, K, "uint8")
    s = Session.create("s", reg, prompt_ids=[1, 2])
    with pytest.raises(InvalidInputError, match="does not extend"):
        s.append_step([1, 3, 4], [5])
    with pytest.raises(InvalidInputError, match="at least one"):
        s.append_step([1, 2], [])
    with pytest.raises(FieldValueError, match=r"'routed_experts': expected shape \(2, 2, 3\)"):
        s.append_step([1, 2], [3], arrays={"routed_experts": np.zeros((3, L, K), np.int32)})
    with pytest.raises(InvalidInputError, match="unknown field 'entropy'"):
        s.append_step([1, 2], [3], arrays={"entropy": np.zeros(1, np.float32)})
    wrong = FieldRef("k", "routed_experts", "u", 2, "int32", (L, K), "p")
    with pytest.raises(InvalidInputError, match="expected"):
        s.append_step([1, 2], [3], refs={"routed_experts": wrong})
    assert s.steps == ()  # failed appends leave no trace
    s.append_step([1, 2], [3], refs={"routed_experts": FieldRef("k", "routed_experts", "u", 2, "uint8", (L, K), "p")})
    s.append_step([1, 2, 3, 9], [4])  # no refs: routed_experts of the context is half offloaded
    with pytest.raises(InvalidInputError, match=r"'routed_experts' has refs in some steps but not in steps \[1\]"):
        lineage_segments(s)


def test_rewrite_and_branch():
    reg = FieldRegistry.builtin(L, K)
    s = Session.create("s", reg)
    a = s.append_step([1, 2], [3], arrays=fields_for(2, 1, 0))
    b = s.append_step([1, 2, 3, 4], [5], arrays=fields_for(2, 1, 1))
    s.rewrite_context([9, 9])
    with pytest.raises(InvalidInputError, match="does not extend"):
        s.append_step([1, 2, 3, 4, 5, 6], [7])
    c = s.append_step([9, 9, 8], [7], arrays=fields_for(3, 1, 2))
    assert (c.start, c.parent, c.prompt_len) == (0, None, 3)
    lin = lineage_segments(s)
    assert [x.segment_id for x in lin] == ["s/l0", "s/l2"]
    assert np.array_equal(lin[1].tokens, [9, 9, 8, 7]) and lin[1].prompt_len == 3
    br = s.branch(0)
    assert br.session_id == "s.b1" and br.steps[0] is a and len(s.steps) == 3
    d = br.append_step([1, 2, 3, 6], [7], arrays=fields_for(2, 1, 3))
    assert (d.index, d.start, d.parent) == (1, 2, a) and b in s.steps and d not in s.steps
    with pytest.raises(InvalidInputError, match="cannot branch from step 5"):
        s.branch(5)


def build(dtype, **kw):
    cfg = SyntheticConfig(sessions=3, steps_per_session=5, layers=L, topk=K, num_experts=200,
                          branch_prob=0.6, rewrite_prob=0.3, seed=7, **kw)
    reg = FieldRegistry.builtin(L, K, dtype)
    writer = MemWriter(reg)
    return build_sessions(cfg, fields=reg, writer=writer, inline=True), writer


def via_ray(segment):
    """What a trainer sees: the sample after a serialisation round trip."""
    sample = segment.to_sample()
    wire = json.loads(json.dumps(sample | {"tokens": sample["tokens"].tolist()}))
    return Segment.from_sample(wire)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_offloaded_equals_inline_bit_for_bit(dtype):
    sessions, writer = build(dtype)
    assert any("." in s.session_id for s in sessions)  # branches happened
    assert any(st.parent is None and st.index > 0 for s in sessions for st in s.steps)  # rewrites happened
    assert {v.dtype.name for (_, k), v in writer.blobs.items() if k.endswith("routed_experts")} == {dtype}
    checked = 0
    for session in sessions:
        for seg in timeline_segments(session) + lineage_segments(session):
            ref_path = inline_fields(seg)
            off_path = materialize_layouts(via_ray(seg), writer.lookup)
            assert set(ref_path) == set(off_path) == {"rollout_log_probs", "rollout_routed_experts"}
            T = len(seg.tokens)
            assert ref_path["rollout_routed_experts"].shape == (T - 1, L, K)
            assert ref_path["rollout_log_probs"].shape == (seg.response_len,)
            for name in ref_path:
                assert off_path[name].dtype == ref_path[name].dtype
                assert off_path[name].tobytes() == ref_path[name].tobytes()
            checked += 1
    assert checked > 20


def test_shared_steps_share_refs():
    sessions, _ = build("uint16")
    users: dict = {}
    for session in sessions:
        for seg in lineage_segments(session):
            for ref in seg.layouts["routed_experts"].refs():
                users.setdefault(ref, set()).add(seg.segment_id)
    assert max(len(v) for v in users.values()) > 1


def test_lineage_slices_to_timeline():
    sessions, writer = build("uint8")
    for session in sessions:
        timeline = {seg.steps[-1].index: seg for seg in timeline_segments(session)}
        for lin in lineage_segments(session):
            for step in lin.steps:
                cut = lin.layouts["routed_experts"].slice(0, step.seqlen - 1)
                assert cut == timeline[step.index].layouts["routed_experts"]


def test_segments_need_no_payload():
    cfg = SyntheticConfig(sessions=2, steps_per_session=4, layers=L, topk=K, branch_prob=0.5, seed=3)

    class RefsOnly(MemWriter):
        def lookup(self, ref):
            raise AssertionError("segment building read a payload")

    reg = FieldRegistry.builtin(L, K, "uint16")
    for session in build_sessions(cfg, fields=reg, writer=RefsOnly(reg), inline=False):
        for seg in timeline_segments(session) + lineage_segments(session):
            assert set(seg.layouts) == {"logprobs", "routed_experts"}
            with pytest.raises(InvalidInputError):
                inline_fields(Segment.from_sample(seg.to_sample()))


def test_sample_is_small_and_validated():
    sessions, _ = build("uint16")
    seg = lineage_segments(sessions[0])[0]
    sample = seg.to_sample()
    payload = sum(v.nbytes for v in inline_fields(seg).values())
    assert len(json.dumps(sample | {"tokens": []})) < payload
    with pytest.raises(InvalidInputError, match="schema version 9"):
        Segment.from_sample(sample | {"schema": 9})
    with pytest.raises(InvalidInputError, match="response_len"):
        Segment.from_sample(sample | {"response_len": 1})
    broken = sample | {"layouts": {"logprobs": sample["layouts"]["routed_experts"]}}
    with pytest.raises(LayoutError, match="does not fit field 'logprobs'"):
        Segment.from_sample(broken)
