"""slime-format samples out of a multi-turn run, hydrated per rank and checked as slime checks them."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.cluster.deploy import local_cluster
from gputq.config import GputqConfig
from gputq.data.trajectory import lineage_segments, timeline_segments
from gputq.errors import InvalidInputError
from gputq.integrations.sglang import RolloutIngest
from gputq.integrations.slime import LOG_PROBS, LOSS_MASK, ROUTED_EXPERTS_KEY, check_sample, hydrate, to_slime_sample
from gputq.tools.synthetic import SyntheticConfig, ingest_synthetic
from tests.conftest import local_units, nixl_usable

SYNTH = SyntheticConfig(sessions=3, steps_per_session=3, layers=3, topk=2, num_experts=200, prompt_tokens=24,
                        tokens_per_step=12, tool_tokens=4, branch_prob=0.5, rewrite_prob=0.3, seed=11)
PARTITION = "rollout-0"
R3_INLINE = GputqConfig(use_rollout_routing_replay=True)  # R3 on, offload off


def _samples(config, writer=None, view=lineage_segments):
    ingest = RolloutIngest(config, num_layers=SYNTH.layers, topk=SYNTH.topk, partition=PARTITION, writer=writer)
    sessions = ingest_synthetic(SYNTH, ingest)
    segments = [seg for s in sessions for seg in view(s)]
    if writer is not None and config.offloaded_fields:
        writer.finalize([seg.layouts for seg in segments], PARTITION)
    # Samples cross Ray to the trainer: only what pickles, no payload for offloaded fields.
    return pickle.loads(pickle.dumps([to_slime_sample(seg) for seg in segments]))


def _inline_reference(view):
    return _samples(R3_INLINE, view=view)


def _assert_same_tensors(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert set(a) == set(b)
        for key in b:
            x, y = np.asarray(a[key]), np.asarray(b[key])
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), key


#: Stored formats and transports of the whole-shard hydrate: packed IDs over every transport.
FORMATS = [("uint8", "tcp"), ("int32", "tcp"), ("packed", "tcp"), ("packed", "shm"),
           pytest.param("packed", "rdma", marks=[pytest.mark.rdma, pytest.mark.skipif(
               nixl_usable() is not None, reason=str(nixl_usable()))])]


@pytest.mark.parametrize("view", [lineage_segments, timeline_segments])
@pytest.mark.parametrize("dtype, transport", FORMATS)
def test_ranks_hydrate_their_split_and_pass_slime_checks(view, dtype, transport):
    with local_units(transport, units=2, routed_experts_dtype=dtype, num_experts=SYNTH.num_experts) as (
            config, services, clients):
        with Writer(clients, config) as writer:
            samples = _samples(config, writer, view)
        assert all(isinstance(s[ROUTED_EXPERTS_KEY], dict) for s in samples)
        with pytest.raises(InvalidInputError, match="rollout_log_probs is"):
            check_sample(samples[0])  # a layout is not what slime trains on
        ranks = [samples[r::2] for r in range(2)]  # slime's data-parallel split
        with Reader(clients, config) as reader:
            for shard in ranks:
                hydrate(shard, reader, PARTITION)
        for sample in samples:
            check_sample(sample)
            assert sample[LOG_PROBS].dtype == np.float32 and sample[ROUTED_EXPERTS_KEY].dtype == np.int32
            assert sum(sample[LOSS_MASK]) <= sample["response_length"]
        _assert_same_tensors([s for r in range(2) for s in ranks[r]],
                             [s for r in range(2) for s in _inline_reference(view)[r::2]])
        assert sum(s.stats()["keys"] for s in services) == 0  # every step released by its last user


@pytest.mark.parametrize("overrides", [{"enabled": False}, {"transfer_params": ("logprobs",)}])
def test_fields_kept_inline_reach_the_trainer_unchanged(overrides):
    base = GputqConfig(enabled=True, use_rollout_routing_replay=True, transport="tcp", num_units=1,
                       unit_capacity_bytes=64 << 20, host="127.0.0.1")
    with local_cluster(base.replace(**overrides)) as (config, services, clients):
        with Writer(clients, config) as writer:
            samples = _samples(config, writer)
        offloaded = {k for s in samples for k, v in s.items() if isinstance(v, dict)}
        assert offloaded == ({LOG_PROBS} if config.enabled else set())
        with Reader(clients, config) as reader:
            hydrate(samples, reader, PARTITION)
        _assert_same_tensors(samples, _inline_reference(lineage_segments))
        if config.enabled:
            assert sum(s.stats()["keys"] for s in services) == 0


def test_loss_mask_marks_generated_tokens_only():
    ingest = RolloutIngest(R3_INLINE, num_layers=SYNTH.layers, topk=SYNTH.topk, partition=PARTITION)
    session = ingest_synthetic(SyntheticConfig(sessions=1, steps_per_session=2, layers=3, topk=2,
                                               tool_tokens=3, seed=1), ingest)[0]
    seg = lineage_segments(session)[0]
    first, second = seg.steps
    mask = to_slime_sample(seg)[LOSS_MASK]
    tool = second.prompt_len - first.seqlen
    assert mask == [1] * first.n_out + [0] * tool + [1] * second.n_out


@pytest.mark.parametrize("key, value, message", [
    (LOG_PROBS, np.zeros(3, np.float64), r"rollout_log_probs is float64\[3\], slime needs float32"),
    (ROUTED_EXPERTS_KEY, np.zeros((5, 1, 1), np.int32), r"needs int32\[4, L, K\]"),
    (LOSS_MASK, [1, 1], "loss_mask has 2 entries, response_length is 3"),
])
def test_check_sample_refuses_what_slime_refuses(key, value, message):
    sample = {"tokens": [1, 2, 3, 4, 5], "response_length": 3, LOSS_MASK: [1, 1, 1],
              LOG_PROBS: np.zeros(3, np.float32), ROUTED_EXPERTS_KEY: np.zeros((4, 1, 1), np.int32)}
    check_sample(sample)
    sample[key] = value
    with pytest.raises(InvalidInputError, match=message):
        check_sample(sample)


def hydrate_and_compare() -> None:
    """Hydrate slime samples with a ``device="cuda"`` reader; check them against the inline path."""
    with local_units("tcp", units=1, routed_experts_dtype="uint16") as (config, _, clients):
        with Writer(clients, config) as writer:
            samples = _samples(config, writer)
        with Reader(clients, config, device="cuda") as reader:
            hydrate(samples, reader, PARTITION)
        for got, want in zip(samples, _inline_reference(lineage_segments)):
            assert got[ROUTED_EXPERTS_KEY].is_cuda and got[LOG_PROBS].is_cuda
            assert np.array_equal(got[ROUTED_EXPERTS_KEY].cpu().numpy(), want[ROUTED_EXPERTS_KEY])
            assert np.array_equal(got[LOG_PROBS].cpu().numpy(), want[LOG_PROBS])


@pytest.mark.gpu
def test_hydrate_on_cuda():
    from gputq.kernels import cuda_available

    if not cuda_available():
        pytest.skip("no usable CUDA device")
    hydrate_and_compare()


@pytest.mark.parametrize("view", [lineage_segments, timeline_segments])
def test_every_rank_of_a_dp_group_streams_its_slice_as_slime_prepares_it(view):
    """Segments of several shared steps, PP 3 x CP 2 ranks streaming and releasing: slime's tensors, keys freed."""
    torch = pytest.importorskip("torch", reason="make test installs torch: slime's rows are stated with it")

    from gputq.data.slices import ParallelSlice
    from gputq.integrations.slime import stream
    from tests.client.test_stream import slime_log_probs, slime_replay_rows

    stages = (range(0, 1), range(1, 2), range(2, 3))
    with local_units("tcp", units=2, routed_experts_dtype="uint8") as (config, services, clients):
        with Writer(clients, config) as writer:
            ingest = RolloutIngest(config, num_layers=SYNTH.layers, topk=SYNTH.topk, partition=PARTITION,
                                   writer=writer)
            segments = [seg for s in ingest_synthetic(SYNTH, ingest) for seg in view(s)]
            writer.finalize([seg.layouts for seg in segments], PARTITION, readers=len(stages) * 2)
        samples = pickle.loads(pickle.dumps([to_slime_sample(seg) for seg in segments]))
        inline = _inline_reference(view)
        batches = [list(range(i, min(len(samples), i + 2))) for i in range(0, len(samples), 2)]
        for stage in stages:
            for cp_rank in range(2):
                rank = ParallelSlice(layers=stage, cp_rank=cp_rank, cp_size=2, num_experts=SYNTH.num_experts)
                with Reader(clients, config) as reader, \
                        stream(samples, reader, batches, rank, release=PARTITION) as mbs:
                    for mb in mbs:
                        want = slime_replay_rows(
                            [torch.from_numpy(np.asarray(inline[i][ROUTED_EXPERTS_KEY])) for i in mb.samples],
                            rank, experts=SYNTH.num_experts)
                        assert np.array_equal(mb.routed_experts[0], want[:, stage[0]].numpy())
                        for i, lp in zip(mb.samples, mb.log_probs):
                            cut = slime_log_probs(torch.from_numpy(np.asarray(inline[i][LOG_PROBS])),
                                                  len(inline[i]["tokens"]), rank)
                            assert np.array_equal(lp, cut.numpy())
        assert sum(s.stats()["keys"] for s in services) == 0  # the last rank past each step freed it
