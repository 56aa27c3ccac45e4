"""The job on a Ray cluster of namespace hosts: run on host 0, the master (``bench.hosts.start_ray``).

``python -m tests.cluster.ray_driver JSON`` (``{"address", "hosts", "samples", "victim"}``):

1. waits for one alive node per host and deploys gputq in cluster mode
   (one unit per node, ``auto`` transport);
2. writes ``samples`` samples from here (the writer on the master) and has
   a trainer rank, a Ray actor, on every host fetch all of them: each
   reports its hostname, the transport ``auto`` chose for each unit, and a
   digest of what it restored;
3. prints a ``ready`` line (its lines start with :data:`MARK`) and waits for a line on stdin: meanwhile the test
   kills host ``victim``'s raylet and unit;
4. waits for Ray to report that node dead, lets the deployment drop its
   unit, asks the controller which references are lost, has the surviving
   ranks fetch what is left, releases the rollout, and prints the result.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from bench.cluster import TrainerRank
from bench.common import digest
from bench.hosts import wait_nodes

__all__ = ["main", "MARK"]

#: Starts the driver's own lines on stdout (Ray prints some there too).
MARK = "@gputq-driver "
_ROWS = 8192  # float32 logprobs: 32 KiB per sample


def _logprobs(i: int) -> np.ndarray:
    return np.random.default_rng(i).random(_ROWS, dtype=np.float32)


def _digest(i: int) -> str:
    """What a rank's restore of sample ``i`` digests to."""
    return digest({"rollout_log_probs": _logprobs(i)})


def main(args: dict) -> dict:
    import ray

    from gputq.client.lifecycle import on_units
    from gputq.client.writer import Writer
    from gputq.cluster.deploy import Deployment
    from gputq.config import GputqConfig
    from gputq.data.refs import Layout

    ray.init(address=args["address"], log_to_driver=False)
    n, victim = args["hosts"], args["victim"]
    wait_nodes(ray, n, 120)
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, transport="auto",
                         unit_capacity_bytes=16 << 20, heartbeat_interval_s=0.5, control_timeout_s=2.0)
    result: dict = {}
    with Deployment.start(config, per_node=True) as deployment:
        config = deployment.config
        membership = deployment.membership()
        result["units"] = {u: a["hostname"] for u, a in membership.items()}
        ray.get(deployment.controller.open_partition.remote("p"))
        with deployment.clients() as clients, Writer(clients, config) as writer:
            refs = [writer.put(f"p/s{i}/0", "p", {"logprobs": _logprobs(i)})["logprobs"]
                    for i in range(args["samples"])]
            writer.flush()
        expected = {i: _digest(i) for i in range(len(refs))}
        rank = ray.remote(num_cpus=0)(TrainerRank)
        ranks = {i: rank.options(resources={f"host{i}": 0.01}).remote(membership, config) for i in range(n)}
        everything = [(i, {"logprobs": Layout.from_ref(ref)}) for i, ref in enumerate(refs)]
        reports = ray.get([r.fetch.remote(everything) for r in ranks.values()])
        result["ranks"] = [{"hostname": r["hostname"], "choices": r["choices"],
                            "exact": sum(r["digests"][i] == expected[i] for i in expected)} for r in reports]
        result["samples"] = len(refs)
        print(MARK + json.dumps({"event": "ready", **result}), flush=True)

        killed_at = float(sys.stdin.readline())  # the test killed the victim's raylet and unit then
        dead_at = wait_nodes(ray, n - 1, 60)
        removed = deployment.sync_nodes()["removed"]
        live = sorted(deployment.membership())
        invariants = ray.get(deployment.controller.check_invariants.remote(refs))
        kept = on_units([{"logprobs": Layout.from_ref(r)} for r in refs], live)
        survivors = [r for i, r in ranks.items() if i != victim]
        again = ray.get([r.fetch.remote([(i, {"logprobs": Layout.from_ref(refs[i])}) for i in kept])
                         for r in survivors])
        released = deployment.release_partition("p")
        ray.get([r.close.remote() for r in survivors])
        result.update(
            node_dead_after_s=dead_at - killed_at, removed=removed, live=live,
            lost_refs=len(refs) - len(kept),
            lost_on_removed=sum(1 for r in refs if r.unit in removed),
            controller_violations=invariants["violations"],
            survivors_exact=[sum(r["digests"][i] == expected[i] for i in kept) for r in again],
            kept=len(kept), released=released, keys_left=deployment.stats()["totals"]["keys"])
    return result


if __name__ == "__main__":
    print(MARK + json.dumps({"event": "done", **main(json.loads(sys.argv[1]))}, default=str), flush=True)
