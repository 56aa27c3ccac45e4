"""A lost unit named before the step: which samples live on it, and a stream that refuses at its start."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gputq.client.reachability import unreachable_samples
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice
from gputq.errors import UnitLostError
from tests.conftest import local_units

pytestmark = pytest.mark.timeout(60)


def _shard(clients, config, n: int = 12):
    with Writer(clients, config) as writer:
        refs = [writer.put(f"s{i}/0", "p", {"routed_experts": np.full((6, 2, 2), i + 1, np.int32),
                                            "logprobs": np.full(3, -i, np.float32)}) for i in range(n)]
        writer.flush()
    return [{name: Layout.from_ref(ref) for name, ref in r.items()} for r in refs], refs


def test_the_samples_on_a_unit_that_stopped_serving_are_named_in_one_round():
    with local_units("tcp", units=3) as (config, services, clients):
        shard, refs = _shard(clients, config)
        on_su1 = [i for i, r in enumerate(refs) if r["logprobs"].unit == "su-1"]
        assert 0 < len(on_su1) < len(shard)  # rendezvous placement spreads the steps
        assert unreachable_samples(shard, clients) == {}
        services[1].close()
        assert clients.lost == {}  # nothing has failed yet: only a probe finds it
        assert unreachable_samples(shard, clients, timeout=5) == {i: ["su-1"] for i in on_su1}
        assert "su-1" in clients.lost  # and marks it, so that nothing else waits on it
        kept = [s for i, s in enumerate(shard) if i not in on_su1]
        with Reader(clients, config) as reader:  # the rest reads exactly
            got = reader.fetch(kept)
        assert [int(g["rollout_routed_experts"][0, 0, 0]) for g in got] == \
            [i + 1 for i in range(len(shard)) if i not in on_su1]


def test_a_stream_refuses_at_its_start_naming_the_samples_on_a_unit_known_lost():
    with local_units("tcp", units=3) as (config, services, clients):
        shard, refs = _shard(clients, config)
        on_su2 = [i for i, r in enumerate(refs) if r["logprobs"].unit == "su-2"]
        services[2].close()
        clients.mark_lost("su-2", "closed by the test")
        rank = ParallelSlice(num_experts=16)
        with Reader(clients, config) as reader:
            with pytest.raises(UnitLostError, match=re.escape(f"units ['su-2'] are lost (closed by the test): "
                                                              f"samples {on_su2} of the shard")) as info:
                reader.stream(shard, [[i] for i in range(len(shard))], rank)
            assert info.value.unit == "su-2"
            kept = [s for i, s in enumerate(shard) if i not in on_su2]
            with reader.stream(kept, [[i] for i in range(len(kept))], rank) as stream:
                assert [mb.index for mb in stream] == list(range(len(kept)))
