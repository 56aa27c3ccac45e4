"""A real consumer: Megatron-core's RouterReplay fed streamed slices routes exactly the stored experts.

2 pipeline stages x 2 CP ranks x 3 micro-batches, over tcp, shm and rdma.
Per stage, one ``RouterReplay`` per layer of the stage takes the stream's
per-layer list through ``RouterReplay.set_replay_data``; routing goes
through ``topk_routing_with_score_function(..., router_replay=...)``, which
runs on CPU. The reference is the inline path: the engine's int32 tensors
prepared for the rank as slime prepares them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="make test installs torch: these tests state slime's rows with it")

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice
from tests.client.test_stream import EXPERTS, LAYERS, TOPK, slime_replay_rows
from tests.conftest import TRANSPORT_PARAMS, local_units

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": CPU fallbacks are the point
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

pytestmark = pytest.mark.timeout(180)

STAGES = (range(0, LAYERS // 2), range(LAYERS // 2, LAYERS))
BATCHES = [[0, 3], [1], [2, 4]]


def _expected_map(indices: torch.Tensor) -> torch.Tensor:
    expected = torch.zeros(len(indices), EXPERTS, dtype=torch.bool)
    expected.scatter_(1, indices.long(), True)
    return expected


def _route(replays, tokens: int, generator) -> list[torch.Tensor]:
    """One MoE forward of the stage: every layer's router under replay; returns the routing maps."""
    maps = []
    for replay in replays:
        logits = torch.randn(tokens, EXPERTS, generator=generator)
        _, routing_map = topk_routing_with_score_function(logits, TOPK, router_replay=replay)
        maps.append(routing_map)
    return maps


@pytest.mark.parametrize("dtype", ["uint8", "packed"])
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_router_replay_selects_exactly_the_stored_experts(transport, dtype):
    rng = np.random.default_rng(11)
    generator = torch.Generator().manual_seed(0)
    lengths = [61, 40, 77, 33, 52]
    inline = [rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.int32) for n in lengths]
    with local_units(transport, units=2, routed_experts_dtype=dtype, num_experts=EXPERTS) as (config, _, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}/0", "p", {"routed_experts": e}) for i, e in enumerate(inline)]
            writer.flush()
        shard = [{name: Layout.from_ref(ref) for name, ref in r.items()} for r in refs]
        checked = 0
        with Reader(clients, config) as reader:
            for stage in STAGES:
                for cp_rank in range(2):
                    rank = ParallelSlice(layers=stage, cp_rank=cp_rank, cp_size=2, num_experts=EXPERTS)
                    RouterReplay.clear_global_router_replay_instances()
                    replays = [RouterReplay() for _ in stage]
                    with reader.stream(shard, BATCHES, rank, total_lengths=lengths) as stream:
                        for mb in stream:
                            want = slime_replay_rows([torch.from_numpy(inline[i]) for i in mb.samples], rank)
                            RouterReplay.set_replay_data([torch.as_tensor(t) for t in mb.routed_experts])
                            for action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
                                RouterReplay.set_global_router_replay_action(action)
                                for j, routing_map in enumerate(_route(replays, len(want), generator)):
                                    assert torch.equal(routing_map, _expected_map(want[:, stage[j]]))
                                    checked += 1
                            RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_instances()
        assert checked == len(STAGES) * 2 * len(BATCHES) * 2 * len(STAGES[0])


def test_slime_records_lazy_handles_up_front_and_a_1f1b_schedule_replays_them():
    """slime's flow: every micro-batch's handles recorded first, then forwards and backwards interleaved."""
    rng = np.random.default_rng(12)
    inline = [rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK)).astype(np.int32) for n in (30, 45, 26, 38)]
    with local_units("tcp", units=1) as (config, _, clients):
        with Writer(clients, config) as writer:
            refs = [writer.put(f"s{i}/0", "p", {"routed_experts": e}) for i, e in enumerate(inline)]
            writer.flush()
        shard = [{name: Layout.from_ref(ref) for name, ref in r.items()} for r in refs]
        rank = ParallelSlice(layers=(1, 4, 5), num_experts=EXPERTS, tp_size=2, sequence_parallel=True, tp_rank=1)
        batches = [[0], [1, 2], [3]]
        with Reader(clients, config) as reader, reader.stream(shard, batches, rank) as stream:
            handles = stream.replay_handles()
            recorded = [[h for h in mb] for mb in zip(*handles)]  # per layer, as RoutingReplay.record keeps them
            assert [len(per_layer) for per_layer in recorded] == [3, 3, 3]
            schedule = [("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2), ("backward", 1),
                        ("backward", 2)]
            for direction, index in schedule:
                want = slime_replay_rows([torch.from_numpy(inline[i]) for i in batches[index]], rank)
                for j, layer in enumerate((1, 4, 5)):
                    got = torch.as_tensor(recorded[j][index].materialize_for_routing_replay(direction))
                    assert got.dtype == torch.int32 and torch.equal(got, want[:, layer]), (direction, index, layer)
                assert len(stream._live) <= 2  # the schedule's in-flight micro-batches, no more
            stream.close()
            assert stream.released == [] and not stream._live  # all consumed; no partition: nothing released
            with pytest.raises(ValueError, match="direction"):
                handles[0][0].materialize_for_routing_replay("sideways")
