"""SGLang responses as they come off the wire, into sessions and StorageUnits."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.config import GputqConfig
from gputq.data.refs import Layout
from gputq.errors import ConfigError, FieldValueError, InvalidInputError
from gputq.integrations.sglang import RolloutIngest, decode_response, encode_response
from tests.conftest import local_units

L, K = 3, 2
R3_INLINE = GputqConfig(use_rollout_routing_replay=True)  # R3 on, offload off


def _engine(rng, prompt_len, n_out, start, *, extra_row=False, experts=64):
    """A response for a prompt of ``prompt_len`` tokens, rows from ``start``."""
    out = rng.integers(0, 1000, n_out)
    rows = prompt_len + n_out - 1 - start + (1 if extra_row else 0)
    routed = rng.integers(0, experts, (rows, L, K), dtype=np.int32)
    logprobs = -rng.random(n_out).astype(np.float32)
    return out, logprobs, routed


def _keys(services):
    return sum(s.stats()["keys"] for s in services)


def test_wire_round_trip_decodes_exactly():
    rng = np.random.default_rng(0)
    out, logprobs, routed = _engine(rng, 5, 4, 0)
    wire = encode_response(out, logprobs, routed)
    assert isinstance(wire["meta_info"]["routed_experts"], str)
    assert len(wire["meta_info"]["output_token_logprobs"][0]) == 3
    decoded = decode_response(wire, L, K)
    assert np.array_equal(decoded.output_ids, out) and decoded.output_ids.dtype == np.int32
    assert np.array_equal(decoded.logprobs, logprobs) and decoded.logprobs.dtype == np.float32
    assert np.array_equal(decoded.routed_experts, routed)
    del wire["output_ids"]  # the triples carry the ids too
    assert np.array_equal(decode_response(wire, L, K).output_ids, out)
    for array in (routed, routed.astype(">i4"), routed.astype(np.uint8), routed.astype(np.int64)):  # in process
        wire["meta_info"]["routed_experts"] = array
        assert np.array_equal(decode_response(wire, L, K).routed_experts, routed)


@pytest.mark.parametrize("mutate, message", [
    (lambda w: w["meta_info"].update(routed_experts="***not base64***"), "not valid base64"),
    (lambda w: w["meta_info"].update(routed_experts=base64.b64encode(b"\0" * 6).decode()), "not whole int32"),
    (lambda w: w["meta_info"].update(routed_experts=base64.b64encode(b"\0" * 20).decode()),
     r"5 int32 values, not a multiple of L×K = 3×2 = 6"),
    (lambda w: w.update(output_ids=w["output_ids"][:-1]), "3 output_ids but 4 output_token_logprobs"),
    (lambda w: w["meta_info"]["output_token_logprobs"].__setitem__(1, (None, 5, None)), "has logprob None"),
    (lambda w: w["meta_info"]["output_token_logprobs"].__setitem__(1, 0.5), r"\[1\] is not a .*triple"),
    (lambda w: w.pop("meta_info"), "no meta_info"),
    (lambda w: w.update(output_ids=["a", "b", "c", "d"]), "output_ids is not a sequence of token ids"),
    # an in-process engine's own array: a cast would truncate floats and wrap wide IDs to valid-looking ones
    (lambda w: w["meta_info"].update(routed_experts=np.full((4, L, K), 1.7)),
     "must hold integer expert IDs, got float64"),
    (lambda w: w["meta_info"].update(routed_experts=np.ones((4, L, K), bool)),
     "must hold integer expert IDs, got bool"),
    (lambda w: w["meta_info"].update(routed_experts=np.full((4, L, K), 2**32 + 1)),
     r"IDs int32 cannot \(range 4294967297"),
])
def test_malformed_responses_name_the_mismatch(mutate, message):
    rng = np.random.default_rng(1)
    wire = encode_response(*_engine(rng, 5, 4, 0))
    mutate(wire)
    with pytest.raises(InvalidInputError, match=message):
        decode_response(wire, L, K)


def _ingest(config, writer=None, **kw):
    return RolloutIngest(config, num_layers=L, topk=K, partition="rollout-0", writer=writer, **kw)


def test_multi_turn_trims_resent_rows_and_stores_only_new_ones():
    rng = np.random.default_rng(2)
    with local_units("tcp", units=1, routed_experts_dtype="uint8") as (config, services, clients):
        with Writer(clients, config) as writer:
            ingest = _ingest(config, writer, keep_inline=True)
            session = ingest.session("s0")
            prompt = rng.integers(0, 1000, 6)
            out, lp, routed = _engine(rng, 6, 3, 0)
            first = ingest.add(session, prompt, encode_response(out, lp, routed), start_len=0)
            assert first.refs["routed_experts"].rows == 8 and first.refs["routed_experts"].dtype == "uint8"
            # Turn 2: the proxy asks from 0 again; SGLang re-sends the 8 known rows (same routing).
            prompt2 = np.concatenate([session.context, rng.integers(0, 1000, 2)])
            out2, lp2, new = _engine(rng, len(prompt2), 4, 8)
            resent = np.concatenate([routed, new])
            second = ingest.add(session, prompt2, encode_response(out2, lp2, resent), start_len=0)
            assert second.start == 8 and second.refs["routed_experts"].rows == len(new)
            assert np.array_equal(second.arrays["routed_experts"], new)
            # Turn 3: re-sent rows that disagree with what turn 1 stored are refused, nothing stored.
            prompt3 = np.concatenate([session.context, rng.integers(0, 1000, 1)])
            out3, lp3, new3 = _engine(rng, len(prompt3), 2, second.seqlen - 1)
            bad = np.concatenate([routed, new, new3])
            bad[4, 1, 0] = (bad[4, 1, 0] + 1) % 64
            writer.flush()
            before = _keys(services)
            with pytest.raises(FieldValueError, match="re-sent for position 4 differ"):
                ingest.add(session, prompt3, encode_response(out3, lp3, bad), start_len=0)
            writer.flush()
            assert _keys(services) == before == 4 and len(session.steps) == 2


def test_seqlen_rows_variant_and_aborted_request():
    rng = np.random.default_rng(3)
    ingest = _ingest(R3_INLINE)  # offload off: no writer, fields inline
    session = ingest.session("s0")
    prompt = rng.integers(0, 1000, 5)
    out, lp, routed = _engine(rng, 5, 3, 0, extra_row=True)
    step = ingest.add(session, prompt, encode_response(out, lp, routed), start_len=0)
    assert np.array_equal(step.arrays["routed_experts"], routed[:-1]) and step.refs == {}
    assert np.array_equal(step.arrays["logprobs"], lp)
    context = session.context.copy()
    assert ingest.add(session, np.concatenate([context, [7]]), encode_response([], [], None),
                      start_len=step.seqlen - 1) is None
    assert ingest.aborted == 1 and len(session.steps) == 1 and np.array_equal(session.context, context)


@pytest.mark.parametrize("rows_delta, start_len, message", [
    (-1, 0, r"routed_experts has 6 rows, but start_len 0 and seqlen 8 \(prompt 5 \+ output 3 tokens\) give 7"),
    (0, 9, r"start_len 9 outside \[0, seqlen=8\)"),
])
def test_rows_against_tokens_against_start_len(rows_delta, start_len, message):
    rng = np.random.default_rng(4)
    ingest = _ingest(R3_INLINE)
    session = ingest.session("s0")
    out, lp, routed = _engine(rng, 5, 3, 0)
    routed = routed[:len(routed) + rows_delta] if rows_delta else routed
    with pytest.raises(InvalidInputError, match=message):
        ingest.add(session, rng.integers(0, 1000, 5), encode_response(out, lp, routed), start_len=start_len)


def test_start_len_past_the_session_is_a_gap():
    rng = np.random.default_rng(5)
    ingest = _ingest(R3_INLINE)
    session = ingest.session("s0")
    out, lp, routed = _engine(rng, 5, 3, 0)
    ingest.add(session, rng.integers(0, 1000, 5), encode_response(out, lp, routed))
    prompt = np.concatenate([session.context, [1, 2]])
    out2, lp2, routed2 = _engine(rng, len(prompt), 2, 9)
    with pytest.raises(InvalidInputError, match=r"start_len 9 is past this context's next position 7"):
        ingest.add(session, prompt, encode_response(out2, lp2, routed2), start_len=9)


def test_rejected_steps_leave_nothing_stored():
    rng = np.random.default_rng(6)
    with local_units("tcp", units=2, routed_experts_dtype="uint8") as (config, services, clients):
        with Writer(clients, config) as writer:
            ingest = _ingest(config, writer)
            session = ingest.session("s0", prompt_ids=[1, 2, 3])
            out, lp, routed = _engine(rng, 5, 3, 0, experts=300)  # IDs beyond uint8
            with pytest.raises(FieldValueError, match="does not fit uint8"):
                ingest.add(session, [1, 2, 3, 4, 5], encode_response(out, lp, routed))
            out, lp, routed = _engine(rng, 5, 3, 0)
            with pytest.raises(InvalidInputError, match="does not extend the current context"):
                ingest.add(session, [9, 2, 3, 4, 5], encode_response(out, lp, routed))
            writer.flush()
            assert _keys(services) == 0 and session.steps == ()
            step = ingest.add(session, [1, 2, 3, 4, 5], encode_response(out, lp, routed))
            writer.flush()
            assert _keys(services) == 2 and set(step.refs) == {"logprobs", "routed_experts"}


def test_packed_ingest_stores_the_wire_ids_at_their_bits_and_refuses_one_past_num_experts():
    rng = np.random.default_rng(9)
    with local_units("tcp", units=1, routed_experts_dtype="packed", num_experts=48) as (config, services, clients):
        with Writer(clients, config) as writer:
            ingest = _ingest(config, writer)
            session = ingest.session("s0", prompt_ids=[1, 2, 3])
            out, lp, routed = _engine(rng, 5, 3, 0, experts=48)
            bad = routed.copy()
            bad[4, 2, 1] = 48  # fits 6 bits' 64, but not the model's 48 experts
            with pytest.raises(FieldValueError, match=r"field 'routed_experts': expert ID 48 at index \[4, 2, 1\] "
                                                      r"is outside \[0, 48\)"):
                ingest.add(session, [1, 2, 3, 4, 5], encode_response(out, lp, bad))
            step = ingest.add(session, [1, 2, 3, 4, 5], encode_response(out, lp, routed))
            writer.flush()
            ref = step.refs["routed_experts"]
            # 2 IDs of 6 bits: 2 bytes a row and layer, against uint8's 2 and int32's 8 on the wire
            assert (ref.num_experts, ref.stored_shape) == (48, (L, 2))
            assert services[0].stats()["bytes_written"] == len(routed) * L * 2 + 4 * len(lp)
            with Reader(clients, config) as reader:
                (got,) = reader.fetch([{"routed_experts": Layout.from_ref(ref)}])
            np.testing.assert_array_equal(got["rollout_routed_experts"], routed)


def test_fields_not_in_transfer_params_stay_inline():
    rng = np.random.default_rng(7)
    with local_units("tcp", units=1, transfer_params=("logprobs",)) as (config, services, clients):
        with Writer(clients, config) as writer:
            ingest = _ingest(config, writer)
            out, lp, routed = _engine(rng, 4, 2, 0)
            step = ingest.add(ingest.session("s0"), [1, 2, 3, 4], encode_response(out, lp, routed))
            assert set(step.refs) == {"logprobs"} and set(step.arrays) == {"routed_experts"}


def test_offload_without_writer_is_a_config_error():
    with pytest.raises(ConfigError, match="needs a writer"):
        _ingest(GputqConfig(enabled=True))


def test_r3_offload_needs_routed_experts_in_the_response():
    with local_units("tcp", units=1) as (config, _, clients), Writer(clients, config) as writer:
        ingest = _ingest(config, writer)
        with pytest.raises(InvalidInputError, match="no meta_info\\['routed_experts'\\]"):
            ingest.add(ingest.session("s0"), [1, 2], encode_response([3], [-0.5], None))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(0, 100), st.booleans()),
                min_size=1, max_size=6))
def test_any_start_len_and_variant_rebuilds_the_context_routing(turns):
    """Whatever start_len each turn sends (up to where the session stands), and whichever
    row-count variant the engine uses, the steps hold each position's routing exactly once."""
    from gputq.data.trajectory import inline_fields, lineage_segments

    truth = np.random.default_rng(len(turns)).integers(0, 64, (400, L, K), dtype=np.int32)
    ingest = _ingest(R3_INLINE)
    session = ingest.session("s0")
    prompt = np.arange(3)
    for tool, n_out, back, extra in turns:
        seqlen = len(prompt) + n_out
        start_len = max(0, session.next_start - back % (session.next_start + 1))
        rows = truth[start_len:seqlen - 1 + (1 if extra else 0)]
        response = encode_response(np.arange(n_out), -np.ones(n_out, np.float32), rows)
        step = ingest.add(session, prompt, response, start_len=start_len)
        if n_out == 0:
            assert step is None
            continue  # an aborted request is retried with the same prompt
        assert np.array_equal(step.arrays["routed_experts"], truth[step.start:seqlen - 1])
        prompt = np.concatenate([session.context, np.arange(tool) + 1000])
    if session.steps:
        (segment,) = lineage_segments(session)
        experts = inline_fields(segment)["rollout_routed_experts"]
        assert np.array_equal(experts, truth[:len(segment.tokens) - 1])


def test_without_r3_routed_experts_are_not_kept():
    rng = np.random.default_rng(8)
    ingest = _ingest(GputqConfig())
    out, lp, routed = _engine(rng, 4, 2, 0)
    step = ingest.add(ingest.session("s0"), [1, 2, 3, 4], encode_response(out, lp, routed))
    assert set(step.arrays) == {"logprobs"} and step.refs == {}
