import numpy as np
import pytest

from gputq.data.fields import FieldRegistry
from gputq.data.keys import step_key
from gputq.errors import ConfigError, FieldValueError
from gputq.tools.synthetic import SyntheticConfig, build_sessions, engine_fields, generate_calls
from tests.data.test_trajectory import MemWriter


def same_calls(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.session_id, x.step_index, x.branch_from) == (y.session_id, y.step_index, y.branch_from)
        assert np.array_equal(x.prompt_ids, y.prompt_ids)
        assert np.array_equal(x.engine_output["output_ids"], y.engine_output["output_ids"])
        for k in ("output_token_logprobs", "routed_experts"):
            assert np.array_equal(x.engine_output["meta_info"][k], y.engine_output["meta_info"][k])


def test_engine_outputs_are_sglang_shaped():
    cfg = SyntheticConfig(sessions=2, steps_per_session=6, layers=3, topk=4, num_experts=10,
                          tool_tokens=5, branch_prob=0.5, rewrite_prob=0.3, seed=1)
    calls = list(generate_calls(cfg))
    prev_end: dict = {}
    for c in calls:
        out, meta = c.engine_output["output_ids"], c.engine_output["meta_info"]
        n_out, seqlen = len(out), len(c.prompt_ids) + len(out)
        # start = where this branch's previous step of the same context stopped
        if c.rewrite is not None:
            start = 0
        elif c.branch_from is not None:
            start = prev_end[c.branch_from]
        else:
            start = prev_end.get((c.session_id, c.step_index - 1), 0)
        lp, ex = meta["output_token_logprobs"], meta["routed_experts"]
        assert lp.dtype == np.float32 and lp.shape == (n_out,) and (lp <= 0).all()
        assert ex.dtype == np.int32 and ex.shape == (seqlen - 1 - start, 3, 4)
        assert ex.min() >= 0 and ex.max() < 10
        prev_end[(c.session_id, c.step_index)] = seqlen - 1
    assert len({len(c.engine_output["output_ids"]) for c in calls}) > 3  # ragged
    assert len({len(c.prompt_ids) for c in calls}) > 3


def test_deterministic_and_per_session_streams():
    cfg = SyntheticConfig(sessions=3, steps_per_session=4, branch_prob=0.5, rewrite_prob=0.3, seed=5)
    same_calls(list(generate_calls(cfg)), list(generate_calls(cfg)))
    one = SyntheticConfig(sessions=1, steps_per_session=4, branch_prob=0.5, rewrite_prob=0.3, seed=5)
    first = [c for c in generate_calls(cfg) if c.session_id.startswith("s0000")]
    same_calls(list(generate_calls(one)), first)
    other = list(generate_calls(SyntheticConfig(sessions=1, seed=6)))
    assert not np.array_equal(other[0].prompt_ids[:8], first[0].prompt_ids[:8])


def test_branch_and_rewrite_probabilities():
    always = list(generate_calls(SyntheticConfig(sessions=1, steps_per_session=4, branch_prob=1.0,
                                                 rewrite_prob=1.0)))
    main = [c for c in always if c.session_id == "s0000"]
    assert len(main) == 4 and all(c.rewrite is not None for c in main[1:])
    assert sum(c.branch_from is not None for c in always) == 4
    never = list(generate_calls(SyntheticConfig(sessions=2, steps_per_session=4)))
    assert len(never) == 8 and all(c.rewrite is None and c.branch_from is None for c in never)


def test_build_sessions_with_writer_keys_and_refs():
    cfg = SyntheticConfig(sessions=2, steps_per_session=3, layers=2, topk=2, branch_prob=0.5, seed=2)
    reg = FieldRegistry.builtin(2, 2, "uint8")
    writer = MemWriter(reg)
    sessions = build_sessions(cfg, fields=reg, writer=writer, partition="r7", inline=False)
    calls = list(generate_calls(cfg))
    assert len(writer.blobs) == 2 * len(calls)
    expected = {f"{step_key('r7', c.session_id, c.step_index)}/{f}" for c in calls
                for f in ("logprobs", "routed_experts")}
    assert {k for _, k in writer.blobs} == expected
    assert step_key("r7", "s0001.b1", 3) == "r7/s0001.b1/3"
    for s in sessions:
        for st in s.steps:
            assert st.arrays == {} and st.refs["routed_experts"].dtype == "uint8"
            assert st.refs["routed_experts"].partition == "r7"


def test_writer_hook_surfaces_range_errors():
    cfg = SyntheticConfig(sessions=1, steps_per_session=2, num_experts=300, seed=0)
    reg = FieldRegistry.builtin(cfg.layers, cfg.topk, "uint8")
    with pytest.raises(FieldValueError, match=r"'rollout-0/s0000/0'.*'routed_experts'.*does not fit uint8"):
        build_sessions(cfg, fields=reg, writer=MemWriter(reg))


def test_engine_fields_and_config_validation():
    call = next(generate_calls(SyntheticConfig(sessions=1, steps_per_session=1)))
    f = engine_fields(call.engine_output)
    assert set(f) == {"logprobs", "routed_experts"} and f["logprobs"].dtype == np.float32
    with pytest.raises(ConfigError, match="layers"):
        SyntheticConfig(layers=0)
    with pytest.raises(ConfigError, match="branch_prob"):
        SyntheticConfig(branch_prob=1.5)
