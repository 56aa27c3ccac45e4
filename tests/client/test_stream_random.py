"""Random streams over real units, each micro-batch against the tests' own statements of slime's rules.

The grid tests pin the configurations slime names; these draw the rest: a rollout of 1-11 samples of
2-89 tokens (so some have one R3 row, logprobs over a random response), a split in a random order, a rank
(CP 1-4, zigzag or allgather; TP 1, 2 or 4 with or without SP; pad multipliers 1, 2, 4; all layers or a
subset), a prefetch depth and ``hold``. Every micro-batch's per-layer rows and CP-cut logprobs must equal
:func:`~tests.client.test_stream.slime_replay_rows` / :func:`~tests.client.test_allgather_cp.allgather_rows`
and :func:`~tests.client.test_stream.slime_log_probs`, and the units must serve exactly the bytes the
stream names. The composed draws build each sample the ways segments are built
(:func:`~tests.client.test_fetch_random._compose`: slices of stored steps, shifted, fill runs, samples
sharing steps), so a micro-batch reads some keys for two samples and some rows from no key at all. Both
kinds also stream into device memory under the CuPy stand-in (:mod:`tests.host_cuda`).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="make test installs torch: these tests state slime's rows with it")

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice
from gputq.data.trajectory import inline_fields, lineage_segments, timeline_segments
from gputq.tools.synthetic import SyntheticConfig, build_sessions
from tests.client.test_allgather_cp import allgather_rows
from tests.client.test_fetch_random import _compose, _on_host
from tests.client.test_stream import EXPERTS, slime_log_probs, slime_replay_rows
from tests.conftest import TRANSPORT_PARAMS, local_units
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

DTYPES = ["uint8", "uint16", "int32", "packed"]
#: The composed R3's fill: not 0, since a rank whose rows are all fill would be refused as an all-zero
#: layer (slime's check of R3 captures). A real R3 layout covers its whole context: it has no fill run.
R3_FILL = 3
#: Expert counts a rollout draws from (packed: 2 to 13 bits an ID); uint8 takes those up to 256. From 4:
#: the composed R3's fill must be an ID.
WIDTHS = (4, 5, 16, 17, 255, 256, 257, 1000, 4097)


def _rollout(writer, rng, tag: str, num_experts: int):
    """A random rollout: ``(shard, [(experts, log_probs, total)])`` with ``[L, K]`` drawn once."""
    layers, topk = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    shard, data = [], []
    for i in range(int(rng.integers(1, 12))):
        total = int(rng.integers(2, 90))
        ids = rng.integers(0, num_experts, (total - 1, layers, topk)).astype(np.int32)
        log_probs = rng.standard_normal(int(rng.integers(1, total))).astype(np.float32)
        refs = writer.put(f"{tag}-{i}/0", "p", {"routed_experts": ids, "logprobs": log_probs})
        shard.append({name: Layout.from_ref(ref) for name, ref in refs.items()})
        data.append((ids, log_probs, total))
    writer.flush()
    return shard, data


def _split(rng, count: int) -> list[list[int]]:
    """The samples in a random order, cut into 1..count micro-batches."""
    order = [int(i) for i in rng.permutation(count)]
    cuts = sorted(int(c) for c in rng.choice(range(1, count), size=int(rng.integers(0, count)), replace=False)) \
        if count > 1 else []
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, count])]


def _rank(rng, layers: int, num_experts: int) -> ParallelSlice:
    cp, tp = int(rng.choice([1, 2, 3, 4])), int(rng.choice([1, 2, 4]))
    subset = None if rng.integers(0, 2) else \
        tuple(sorted(int(v) for v in rng.choice(layers, size=int(rng.integers(1, layers + 1)), replace=False)))
    return ParallelSlice(layers=subset, cp_rank=int(rng.integers(0, cp)), cp_size=cp, tp_rank=int(rng.integers(0, tp)),
                         tp_size=tp, sequence_parallel=bool(rng.integers(0, 2)), pad_multiple=int(rng.choice([1, 2, 4])),
                         num_experts=num_experts, allgather_cp=cp > 1 and bool(rng.integers(0, 2)))


def _want(samples: list[np.ndarray], rank: ParallelSlice) -> np.ndarray:
    """The rank's ``[tokens, L, K]`` rows of a micro-batch, as slime prepares them."""
    if rank.allgather_cp:
        return allgather_rows(samples, rank.cp_size, rank.cp_rank, rank.tp_size, rank.tp_rank,
                              rank.sequence_parallel, rank.pad_multiple, rank.num_experts)
    return slime_replay_rows([torch.from_numpy(s) for s in samples], rank, experts=rank.num_experts).numpy()


def _check_micro_batch(mb, samples: list, rank: ParallelSlice, layers, case: str) -> None:
    """``mb`` against slime's rows of its ``samples``, each ``(experts, log_probs, total)``: the R3 of every
    layer of ``layers`` (int32), and each sample's CP-cut logprobs."""
    want = _want([experts for experts, _, _ in samples], rank)
    for j, layer in enumerate(layers):
        got = _on_host(mb.routed_experts[j])
        assert got.dtype == np.int32, case
        np.testing.assert_array_equal(got, want[:, layer], err_msg=case)
    for (_, log_probs, total), got in zip(samples, mb.log_probs):
        expected = slime_log_probs(torch.from_numpy(log_probs), total, rank).numpy()
        np.testing.assert_array_equal(_on_host(got), expected, err_msg=case)


def _check_stream(reader, units, shard, data, rng, num_experts: int) -> int:
    """Stream one random configuration and check it; returns the micro-batches checked."""
    splits, rank = _split(rng, len(shard)), _rank(rng, data[0][0].shape[1], num_experts)
    layers = tuple(range(data[0][0].shape[1])) if rank.layers is None else rank.layers
    prefetch, hold = int(rng.integers(1, 4)), bool(rng.integers(0, 2))
    case = f"{rank}, split {splits}, prefetch {prefetch}, hold {hold}"
    before = sum(unit.stats()["bytes_read"] for unit in units)
    with reader.stream(shard, splits, rank, prefetch=prefetch, hold=hold) as stream:
        for mb in stream:
            batch = splits[mb.index]
            assert mb.samples == tuple(batch) and mb.layers == layers, case
            _check_micro_batch(mb, [data[i] for i in batch], rank, layers, case)
            if hold:
                mb.release()
        slice_bytes = stream.slice_bytes
    assert sum(unit.stats()["bytes_read"] for unit in units) - before == slice_bytes, case
    return len(splits)


def _composed_rollout(writer, rng, tag: str, num_experts: int):
    """1-7 stored steps and 1-5 samples composed of them: ``(shard, [(experts, log_probs, total)])``."""
    layers, topk = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    experts, log_probs = [], []
    for i in range(int(rng.integers(1, 8))):
        rows = int(rng.integers(1, 40))
        fields = {"routed_experts": rng.integers(1, num_experts, (rows, layers, topk)).astype(np.int32),
                  "logprobs": rng.standard_normal(rows).astype(np.float32)}
        refs = writer.put(f"{tag}-{i}/0", "p", fields)
        experts.append((Layout.from_ref(refs["routed_experts"], fill=R3_FILL), fields["routed_experts"]))
        log_probs.append((Layout.from_ref(refs["logprobs"]), fields["logprobs"]))
    writer.flush()
    shard, data = [], []
    for _ in range(int(rng.integers(1, 6))):
        r3, rows = _compose(rng, experts)
        if not r3.rows:  # R3 has a row per token but the last
            r3, rows = experts[0]
        response, values = _compose(rng, log_probs)
        if not response.rows:
            response, values = log_probs[0]
        keep = min(response.rows, r3.rows)  # a response of 1 to T - 1 tokens
        shard.append({"routed_experts": r3, "logprobs": response.slice(0, keep)})
        data.append((rows, values[:keep], r3.rows + 1))
    return shard, data


def _run(transport: str, dtype: str, seeds, configs: int, rollout=_rollout, device: str = "cpu") -> int:
    checked = 0
    for seed in seeds:
        rng = np.random.default_rng([seed, DTYPES.index(dtype)])
        widths = [w for w in WIDTHS if dtype != "uint8" or w <= 256]
        experts = widths[(3 * seed + DTYPES.index(dtype)) % len(widths)]  # the fast seeds draw two apart
        with local_units(transport, units=int(rng.integers(1, 4)), routed_experts_dtype=dtype, num_experts=experts,
                         capacity=16 << 20) as (config, units, clients):
            with Writer(clients, config) as writer:
                shard, data = rollout(writer, rng, f"r{seed}", experts)
            with Reader(clients, config, device=device) as reader:
                checked += sum(_check_stream(reader, units, shard, data, rng, experts) for _ in range(configs))
    return checked


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_random_streams_give_slimes_rows_and_move_exactly_their_slice(transport, dtype):
    assert _run(transport, dtype, range(2), 6) >= 12


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_random_streams_many(transport, dtype):
    assert _run(transport, dtype, range(2, 42), 8) >= 320


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_random_streams_of_composed_samples_give_slimes_rows_and_move_exactly_their_slice(transport, dtype):
    assert _run(transport, dtype, range(2), 6, _composed_rollout) >= 12


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_random_streams_of_composed_samples_many(transport, dtype):
    assert _run(transport, dtype, range(2, 42), 8, _composed_rollout) >= 320


def _inline(segment) -> tuple:
    """A segment's ``(experts, log_probs, total)`` as the non-offloaded path gives them."""
    fields = inline_fields(segment)
    return fields["rollout_routed_experts"], fields["rollout_log_probs"], len(segment.tokens)


def _rank_streams(clients, config, group: list, rank: ParallelSlice, batches: list, errors: list,
                  first=None) -> None:
    """One rank's pass over its DP group's segments, releasing each micro-batch; what goes wrong in ``errors``.
    ``first()``, if given, runs once the first micro-batch is checked (a rank pausing there)."""
    try:
        with Reader(clients, config) as reader, \
                reader.stream([seg.layouts for seg in group], batches, rank, release="r0",
                              total_lengths=[len(seg.tokens) for seg in group]) as stream:
            for mb in stream:
                _check_micro_batch(mb, [_inline(group[i]) for i in batches[mb.index]], rank, rank.layers,
                                   f"{rank}, micro-batch {mb.index}")
                if mb.index == 0 and first is not None:
                    first()
    except BaseException as exc:  # noqa: BLE001 - the test asserts there was none
        errors.append((rank, exc))


@pytest.mark.parametrize("view", [timeline_segments, lineage_segments], ids=["timeline", "lineage"])
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_every_rank_of_two_dp_groups_streams_and_releases_at_once_and_nothing_is_freed_early_or_left(transport,
                                                                                                      view):
    """Two DP groups of PP 2 x CP 2 ranks, each rank a Reader of its own on a thread, stream their group's
    segments in random splits and release each micro-batch; the groups share steps (prefixes of one session).
    Every micro-batch is exact, and once all are done no key and no byte is left."""
    rng = np.random.default_rng(7)
    synth = SyntheticConfig(sessions=4, steps_per_session=4, layers=4, topk=4, num_experts=EXPERTS, prompt_tokens=30,
                            tokens_per_step=20, tool_tokens=5, branch_prob=0.4, rewrite_prob=0.2, seed=3)
    with local_units(transport, units=3, num_experts=EXPERTS, routed_experts_dtype="packed") as (config, units,
                                                                                                clients):
        with Writer(clients, config) as writer:
            sessions = build_sessions(synth, fields=config.field_registry(synth.layers, synth.topk), writer=writer,
                                      partition="r0")
            segments = [seg for session in sessions for seg in view(session)]
            segments = [segments[i] for i in rng.permutation(len(segments))]
            writer.finalize([seg.layouts for seg in segments], "r0", readers=4)  # PP x CP ranks per group
        errors: list = []
        threads = [threading.Thread(target=_rank_streams, args=(
                       clients, config, segments[dp::2],
                       ParallelSlice(layers=(2 * pp, 2 * pp + 1), cp_rank=cp, cp_size=2, num_experts=EXPERTS),
                       _split(rng, len(segments[dp::2])), errors))
                   for dp in range(2) for pp in range(2) for cp in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads) and not errors, errors
        assert sum(unit.stats()["keys"] for unit in units) == 0
        # A released key's bytes come back once its last lease ends, and a closed reader's ends may still be
        # on their way (sent on a thread of their own).
        wait_until(lambda: sum(unit.stats()["used"] for unit in units) == 0, 10, "every byte freed")


@pytest.mark.parametrize("rollout", [_rollout, _composed_rollout], ids=["plain", "composed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_random_streams_into_device_memory_under_the_cuda_stand_in(shm_leases_checked, transport, dtype, rollout):
    """device="cuda": staged or mapped compact bytes widened by the kernel (packed IDs: the unpack kernel),
    pads and views on the device, each micro-batch copied back to be checked."""
    assert _run(transport, dtype, range(2), 6, rollout, device="cuda") >= 12
    assert any(entry[0] == "launch" for entry in shm_leases_checked.log)
