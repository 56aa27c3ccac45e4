"""Cluster mode on a multi-node Ray cluster simulated on this machine (several raylets)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray not installed (pip install 'gputq[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from gputq.client.writer import Writer  # noqa: E402
from gputq.cluster.deploy import Deployment  # noqa: E402
from gputq.cluster.names import CONTROLLER_NAME, NAMESPACE  # noqa: E402
from gputq.config import GputqConfig  # noqa: E402
from gputq.data.refs import Layout  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]


class ShardReader:
    """A trainer rank on its own node: reads its shard and reports where it ran and what it got."""

    def read(self, membership: dict, config: GputqConfig, samples: list[dict]) -> dict:
        from gputq.client.clients import UnitClients
        from gputq.client.reader import Reader

        layouts = [{name: Layout.from_dict(d) for name, d in sample.items()} for sample in samples]
        with UnitClients(membership, config) as clients, Reader(clients, config) as reader:
            restored = reader.fetch(layouts)
        digest = hashlib.sha256()
        for fields in restored:
            digest.update(np.ascontiguousarray(fields["rollout_routed_experts"]).data)
        return {"node": ray.get_runtime_context().get_node_id(), "digest": digest.hexdigest()}


def _write(clients, config, count, prefix, rng):
    expected, samples = hashlib.sha256(), []
    with Writer(clients, config) as writer:
        for i in range(count):
            experts = rng.integers(0, 250, (40, 4, 2), dtype=np.int32)
            refs = writer.put(f"{prefix}/s{i}/0", prefix, {"routed_experts": experts})
            samples.append({"routed_experts": Layout.from_ref(refs["routed_experts"]).to_dict()})
            expected.update(experts.data)
        writer.flush()
    return samples, expected.hexdigest()


def _read_on(node_id, membership, config, samples):
    reader = ray.remote(num_cpus=0)(ShardReader).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    return ray.get(reader.read.remote(membership, config, samples), timeout=120)


def test_one_unit_per_node_remote_readers_and_a_late_node():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        config = GputqConfig(enabled=True, use_rollout_routing_replay=True, transport="tcp",
                             routed_experts_dtype="uint8", unit_capacity_bytes=8 << 20)
        with Deployment.start(config, ray_address=cluster.address) as dep:
            assert dep.per_node
            nodes = ray.get(dep.controller.nodes.remote())
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            assert set(nodes.values()) == alive and len(nodes) == 2  # one unit per node
            # The units run where they are pinned.
            for name, handle in dep.units.items():
                assert ray.get(handle.stats.remote())["name"] == name
            assert ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE) is not None
            # The controller sits on the driver's node, not on one that may leave.
            where = ray.get(dep.controller.__ray_call__.remote(
                lambda _: ray.get_runtime_context().get_node_id()))
            assert where == ray.get_runtime_context().get_node_id()
            rng = np.random.default_rng(0)
            with dep.clients() as clients:
                samples, expected = _write(clients, dep.config, 12, "rollout-0", rng)
            got = _read_on(worker.node_id, dep.membership(), dep.config, samples)
            assert got == {"node": worker.node_id, "digest": expected}

            late = cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            change = dep.sync_nodes()
            assert len(change["added"]) == 1 and change["removed"] == []
            nodes = ray.get(dep.controller.nodes.remote())
            assert nodes[change["added"][0]] == late.node_id and len(nodes) == 3
            with dep.clients() as clients:
                samples, expected = _write(clients, dep.config, 24, "rollout-1", rng)
            assert {Layout.from_dict(s["routed_experts"]).refs()[0].unit for s in samples} == set(nodes)
            got = _read_on(late.node_id, dep.membership(), dep.config, samples)
            assert got == {"node": late.node_id, "digest": expected}
            assert dep.sync_nodes() == {"added": [], "removed": []}

        # With a watcher, joins and departures need no call at all.
        with Deployment.start(config, ray_address=cluster.address, watch_nodes_s=0.5) as dep:
            assert len(dep.membership()) == 3
            cluster.remove_node(late)
            wait_until(lambda: len(dep.membership()) == 2, 90, "the departed node's unit left the membership",
                       interval=0.2)
            assert late.node_id not in ray.get(dep.controller.nodes.remote()).values()
            joined = cluster.add_node(num_cpus=1)
            wait_until(lambda: joined.node_id in ray.get(dep.controller.nodes.remote()).values(), 90,
                       "the joining node got a unit", interval=0.2)
            assert len(dep.membership()) == 3
    finally:
        ray.shutdown()
        cluster.shutdown()
