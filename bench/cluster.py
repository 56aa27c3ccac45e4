"""The whole path across N hosts built on this machine, end to end, and torn down.

``python -m bench.cluster [--hosts 3] [--sessions 6] [--dtype uint16] [--json]`` (as root)

Builds ``--hosts`` hosts (:mod:`bench.hosts`: a network namespace, address,
hostname and /dev/shm each, one Ray node each, token authentication on)
and runs the job on host 0, the master:

1. gputq in cluster mode: the controller on host 0, one StorageUnit per
   host (``auto`` transport);
2. the writer on host 0 writes a seeded synthetic rollout (routed-expert
   IDs stored as ``--dtype``, logprobs) and keeps lightweight samples;
3. a trainer rank, a Ray actor, on every other host fetches and restores
   its data-parallel shard twice (cold: connections made on the way; warm);
   every restored sample is checked bit-exact against the rollout's inline
   fields;
4. the rollout is released (no key may be left).

It prints the transport ``auto`` chose for every (reader, unit) pair and a
timing table (fetch+restore: the time a trainer waits), then tears
everything down, also on failure and Ctrl-C, and reports what survived
(nothing, or it exits 1). Without CAP_NET_ADMIN it says why and exits 0
(``"skipped"`` in the JSON).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from bench.common import (
    add_json_flag,
    add_rollout_flags,
    digest,
    emit_json,
    gbps,
    print_header,
    print_table,
    synthetic_config,
)

__all__ = ["TrainerRank", "as_promised", "job", "main"]

_MIB = 1 << 20


class TrainerRank:
    """One data-parallel rank on its own host: fetches and restores what it is given, and digests it."""

    def __init__(self, membership: dict, config):
        from gputq.client.clients import UnitClients
        from gputq.client.reader import Reader

        self._clients = UnitClients(membership, config)
        self._reader = Reader(self._clients, config)

    def fetch(self, shard: list[tuple[object, dict]]) -> dict:
        """Restore ``shard`` (pairs of sample id and its field layouts).

        Returns this host's name, each sample's digest, the seconds the
        fetch and restore took, the bytes restored, and the transport (and
        why) chosen for every unit.
        """
        started = time.perf_counter()
        got = self._reader.fetch([layouts for _, layouts in shard])
        seconds = time.perf_counter() - started
        return {"hostname": socket.gethostname(), "seconds": seconds,
                "bytes": sum(a.nbytes for fields in got for a in fields.values()),
                "digests": {i: digest(fields) for (i, _), fields in zip(shard, got)},
                "choices": {u: list(self._clients.transport_of(u)) for u in self._clients.units}}

    def close(self) -> None:
        self._reader.close()
        self._clients.close()


def _expected(cfg) -> dict:
    """Each segment's digest on the path without offload (its fields inline)."""
    from gputq.data.fields import FieldRegistry
    from gputq.data.trajectory import inline_fields, lineage_segments
    from gputq.tools.synthetic import build_sessions

    sessions = build_sessions(cfg, fields=FieldRegistry.builtin(cfg.layers, cfg.topk), inline=True)
    return {seg.segment_id: digest(inline_fields(seg)) for session in sessions for seg in lineage_segments(session)}


def job(args) -> dict:
    """The job on host 0 of a running cluster (``args.ray_address``): deploy, write, fetch, check, release."""
    from bench.hosts import wait_nodes
    from gputq.client.writer import Writer
    from gputq.cluster.deploy import Deployment
    from gputq.cluster.names import import_ray
    from gputq.config import GputqConfig
    from gputq.data.fields import FieldRegistry
    from gputq.data.trajectory import Segment, lineage_segments
    from gputq.tools.synthetic import build_sessions

    ray = import_ray()
    started = time.monotonic()
    ray.init(address=args.ray_address, log_to_driver=False)
    nodes_up = wait_nodes(ray, args.hosts, 120) - started
    cfg = synthetic_config(args, args.sessions)
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, routed_experts_dtype=args.dtype,
                         transport="auto", unit_capacity_bytes=args.capacity_mib * _MIB)
    timings = {"nodes_alive_s": nodes_up}
    with Deployment.start(config, per_node=True) as deployment:
        timings["deploy_s"] = time.monotonic() - started - nodes_up
        config = deployment.config
        membership = deployment.membership()
        fields = FieldRegistry.builtin(cfg.layers, cfg.topk, args.dtype)
        ray.get(deployment.controller.open_partition.remote("p"))
        put_started = time.perf_counter()
        with deployment.clients() as clients, Writer(clients, config) as writer:
            sessions = build_sessions(cfg, fields=fields, writer=writer, partition="p", inline=False)
            segments = [seg for session in sessions for seg in lineage_segments(session)]
            writer.finalize([seg.layouts for seg in segments], "p")
            writer.flush()
            written = writer.bytes_written
        put_s = time.perf_counter() - put_started
        samples = [(seg.segment_id, seg.to_sample()) for seg in segments]
        expected = _expected(cfg)
        rank = ray.remote(num_cpus=0)(TrainerRank)
        ranks = [rank.options(resources={f"host{i}": 0.01}).remote(membership, config) for i in range(1, args.hosts)]
        shards = [[(i, Segment.from_sample(s).layouts) for i, s in samples[r::len(ranks)]]
                  for r in range(len(ranks))]
        try:
            cold = ray.get([r.fetch.remote(shard) for r, shard in zip(ranks, shards)])
            warm = ray.get([r.fetch.remote(shard) for r, shard in zip(ranks, shards)])
        finally:
            ray.get([r.close.remote() for r in ranks])
        released = deployment.release_partition("p")
        keys_left = deployment.stats()["totals"]["keys"]
    reports = []
    for r, (c, w) in enumerate(zip(cold, warm)):
        exact = sum(c["digests"][i] == expected[i] == w["digests"][i] for i, _ in shards[r])
        reports.append({"rank": r, "hostname": c["hostname"], "samples": len(shards[r]), "exact": exact,
                        "bytes": c["bytes"], "cold_s": c["seconds"], "warm_s": w["seconds"],
                        "choices": c["choices"]})
    return {"units": {u: a["hostname"] for u, a in membership.items()}, "ranks": reports,
            "samples": len(samples), "stored_bytes": written, "put_s": put_s, "timings": timings,
            "freed": released.get("freed"), "unreachable": released.get("unreachable"), "keys_left": keys_left}


def _report(result: dict) -> None:
    units = result["units"]
    pairs = [{"reader": rank["hostname"], "unit": unit, "unit_host": units[unit], "transport": choice[0],
              "why": choice[1]} for rank in result["ranks"] for unit, choice in sorted(rank["choices"].items())]
    print("transport auto chose, per (reader, unit):")
    print_table(pairs, ["reader", "unit", "unit_host", "transport", "why"])
    rows = [{"phase": "Ray nodes alive (from the job's start)", "s": result["timings"]["nodes_alive_s"]},
            {"phase": "deployment (controller + a unit per host)", "s": result["timings"]["deploy_s"]},
            {"phase": "write: the writer on host 0 (generation included)", "s": result["put_s"],
             "MiB": result["stored_bytes"] / _MIB, "GB/s": gbps(result["stored_bytes"], result["put_s"])}]
    for rank in result["ranks"]:
        for kind in ("cold", "warm"):
            rows.append({"phase": f"fetch+restore rank {rank['rank']} on {rank['hostname']}, {kind}",
                         "s": rank[f"{kind}_s"], "MiB": rank["bytes"] / _MIB,
                         "GB/s": gbps(rank["bytes"], rank[f"{kind}_s"])})
    rows += [{"phase": "build hosts (namespaces, bridge)", "s": result["harness"]["build_s"]},
             {"phase": "teardown (every process, namespace, temp dir)", "s": result["harness"]["teardown_s"]}]
    print("timings (MiB restored are int32 IDs and float32 logprobs, as the trainer gets them):")
    print_table(rows, ["phase", "s", "MiB", "GB/s"])
    exact = sum(r["exact"] for r in result["ranks"])
    print(f"restored bit-exact: {exact}/{result['samples']} samples; transports as auto promises: "
          f"{result['transports_as_promised']}; keys left after release: {result['keys_left']}; "
          f"left behind: {result['leftovers']}")


def as_promised(result: dict) -> bool:
    """Whether ``auto`` chose shm for every same-host pair and rdma or tcp for every other one."""
    return all((choice[0] == "shm") if result["units"][unit] == rank["hostname"] else choice[0] in ("rdma", "tcp")
               for rank in result["ranks"] for unit, choice in rank["choices"].items())


def _ok(result: dict) -> bool:
    clean = not any(result["leftovers"].values())
    exact = sum(r["exact"] for r in result["ranks"]) == result["samples"]
    return clean and exact and result["keys_left"] == 0 and result["transports_as_promised"]


def main(argv=None) -> None:
    from bench.hosts import bench_on_hosts

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=3, help="hosts to build (one Ray node and unit each)")
    add_rollout_flags(parser, sessions=6, steps=3, tokens=1024)
    parser.add_argument("--dtype", choices=("uint8", "uint16", "int32"), default="uint16",
                        help="stored expert-ID dtype (restored as int32)")
    parser.add_argument("--capacity-mib", type=int, default=128, help="each unit's arena")
    parser.add_argument("--limit-s", type=float, default=300, help="the job's wall-clock limit")
    parser.add_argument("--ray-address", help=argparse.SUPPRESS)  # set for the job on host 0
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.hosts < 2:
        parser.error("--hosts must be at least 2")
    if args.ray_address:
        emit_json(job(args))
        return
    print_header("the whole path across hosts", hosts=args.hosts, sessions=args.sessions, steps=args.steps,
                 tokens=args.tokens, row=f"L={args.layers} K={args.topk}", dtype=args.dtype,
                 transport="auto", cpus=os.cpu_count())
    # tmpfs pages count only when written: room for the arena and Ray's store on every host
    result = bench_on_hosts("cluster", args.hosts, argv, json_line=args.json, limit_s=args.limit_s,
                            shm_bytes=(args.capacity_mib + 256) * _MIB, object_store_bytes=128 * _MIB)
    if result is None:
        return
    result.update(bench="cluster", transports_as_promised=as_promised(result))
    result["verified"] = _ok(result)
    _report(result)
    if args.json:
        emit_json(result)
    if not result["verified"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
