"""gputq and Mooncake Store across two hosts: the stored bytes on one, the reader on the other.

``python -m bench.peers_hosts [--sizes 16,64,256] [--json]`` (as root)

Builds two hosts (:mod:`bench.hosts`: a network namespace, address,
hostname and /dev/shm each, one Ray node each, joined by a bridge) and
runs the job on host 0, where the writer and the reader live; host 1 holds
the bytes:

- ``gputq-auto``: a StorageUnit on every host (cluster mode); the shard's
  keys are the ones the writer places on host 1's unit, so every byte
  crosses the link both ways; the reader's channel to that unit is the one
  ``auto`` picks for a peer on another host (tcp without InfiniBand);
- ``gputq-auto-uint8`` (``uint16`` for more than 256 experts): the same,
  the IDs stored compact, as a deployment configures them; the same int32
  arrays go in and come out;
- ``mooncake``: the master on host 0, the holder contributing the only
  global segment on host 1 (a Ray actor there), the client on host 0
  contributing none, ``batch_put_from`` and ``batch_get_into`` over
  registered buffers, as in :mod:`bench.peers`.

Each system is torn down before the next starts (the Ray nodes stay: they
are the harness). The shard and the timing are :mod:`bench.peers`'; with
``--json`` the last line holds the rows and ``get_speedup_vs_mooncake``,
``put_speedup_vs_mooncake_int32`` and, for the compact row,
``get_speedup_vs_mooncake_compact`` and ``put_speedup_vs_mooncake`` (each
the smallest over the sizes).
Without CAP_NET_ADMIN it says why and exits 0.
"""

from __future__ import annotations

import argparse
import socket
import sys

from bench.common import add_json_flag, emit_json, gbps, print_header, print_table
from bench.peers import HEADLINE, check_same, compact_dtype, gputq_rounds, make_shard, measure_rounds, speedups

__all__ = ["job", "main"]

_MIB = 1 << 20


def _remote_keys(prefix: str, count: int, units: list[str], remote: str) -> list[str]:
    """``count`` step keys under ``prefix`` that the writer's placement puts on ``remote``."""
    from gputq.client.placement import rendezvous_unit

    keys, salt = [], 0
    while len(keys) < count:
        key = f"{prefix}/{salt}"
        if rendezvous_unit(key, units) == remote:
            keys.append(key)
        salt += 1
    return keys


def _gputq(shards: dict, repeats: int, dtype: str) -> dict:
    from gputq.client.reader import Reader
    from gputq.client.writer import Writer
    from gputq.cluster.deploy import Deployment
    from gputq.config import GputqConfig

    biggest = max(sum(a.nbytes for a in s) for s in shards.values())
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, routed_experts_dtype=dtype,
                         transport="auto", unit_capacity_bytes=3 * biggest + 64 * _MIB)
    with Deployment.start(config, per_node=True) as deployment:
        here = socket.gethostname()
        remote = next(u for u, a in deployment.membership().items() if a.get("hostname") != here)
        with deployment.clients() as clients, Writer(clients, deployment.config) as writer, \
                Reader(clients, deployment.config) as reader:
            out, restore = gputq_rounds(
                writer, reader, deployment, shards, repeats,
                lambda size, i, count: _remote_keys(f"{size}/{i}", count, clients.live_units, remote))
            via = clients.transport_of(remote)[0]
    return {"timings": out, "via": via, "stored": dtype, "restore": restore}


def _mooncake(shards: dict, repeats: int, here: str, there: str) -> dict:
    import ray

    from bench.mooncake import MooncakeClient, MooncakeMaster, SegmentHolder

    biggest = max(sum(a.nbytes for a in s) for s in shards.values())
    out = {}
    with MooncakeMaster(here) as master:
        holder = ray.remote(num_cpus=0)(SegmentHolder).options(resources={"host1": 0.01}).remote(
            master.address, 2 * biggest + 64 * _MIB, there)
        ray.get(holder.pid.remote())  # mounted
        client = MooncakeClient(master.address, biggest, here)
        try:
            for size, shard in shards.items():
                spans = client.stage(shard)
                keys = {}

                def put(i):
                    keys[i] = [f"{size}/{i}/{j}" for j in range(len(shard))]
                    client.put(keys[i], spans, len(shard))

                def get(i):
                    client.get(keys[i], spans, len(shard))
                    return client.arrays(spans, shard)

                out[size] = measure_rounds(put, get, lambda i: client.remove(keys.pop(i)),
                                           lambda got: check_same(shard, got), repeats)
        finally:
            client.close()
            ray.get(holder.close.remote())
            ray.kill(holder)
    return {"timings": out, "via": "tcp", "stored": "int32"}


def job(args) -> dict:
    """The job on host 0 of a running two-host cluster: each system in turn, then the ratios."""
    import ray

    from bench.hosts import wait_nodes

    ray.init(address=args.ray_address, log_to_driver=False)
    wait_nodes(ray, 2, 120)
    here = args.ray_address.split(":")[0]
    there = next(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and "host1" in n["Resources"])
    shards = {float(s): make_shard(float(s), args.layers, args.topk, args.rows, experts=args.experts)
              for s in args.sizes.split(",")}
    rows = []
    compact = compact_dtype(args.experts)
    systems = {HEADLINE: lambda: _gputq(shards, args.repeats, "int32"),
               f"{HEADLINE}-{compact}": lambda: _gputq(shards, args.repeats, compact),
               "mooncake": lambda: _mooncake(shards, args.repeats, here, there)}
    for system, run in systems.items():
        result = run()
        for size, (put_s, get_s, faults) in result["timings"].items():
            nbytes = sum(a.nbytes for a in shards[size])
            rows.append({"system": system, "via": result["via"], "stored": result["stored"],
                         "shard_MiB": round(nbytes / _MIB, 2), "samples": len(shards[size]),
                         "put_GBps": round(gbps(nbytes, put_s), 3), "get_GBps": round(gbps(nbytes, get_s), 3),
                         "put_ms": round(put_s * 1e3, 2), "get_ms": round(get_s * 1e3, 2)})
            if size in result.get("restore", {}):
                rows[-1]["restore_ms"] = round(result["restore"][size] * 1e3, 2)
    return {"rows": rows, "holder_host": there, "reader_host": here,
            **speedups(rows, list(systems), min(shards))}


def main(argv=None) -> None:
    from bench.hosts import bench_on_hosts

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.peers_hosts", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64,256", help="shard sizes in MiB, comma separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--experts", type=int, default=128, help="IDs are below this; sets the compact dtype")
    parser.add_argument("--limit-s", type=float, default=900, help="the job's wall-clock limit")
    parser.add_argument("--ray-address", help=argparse.SUPPRESS)  # set for the job on host 0
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.ray_address:
        emit_json(job(args))
        return
    biggest = max(float(s) for s in args.sizes.split(","))
    print_header("R3 shard put/get across two hosts: gputq vs Mooncake Store", sizes_MiB=args.sizes,
                 repeats=args.repeats,
                 sample=f"[{args.rows}, {args.layers}, {args.topk}] int32 (IDs below {args.experts})",
                 hosts="2 network namespaces on one machine, a bridge between them", devices="host memory")
    # Room on host 1's /dev/shm for its arena (three shards and slack) and Ray's store.
    result = bench_on_hosts("peers_hosts", 2, argv, json_line=args.json, limit_s=args.limit_s,
                            shm_bytes=int((4 * biggest + 512) * _MIB), object_store_bytes=128 * _MIB)
    if result is None:
        return
    print_table(result["rows"], ["system", "via", "stored", "shard_MiB", "samples", "put_GBps", "get_GBps", "put_ms",
                                 "get_ms", "restore_ms"])
    for key in ("get_speedup_vs_mooncake", "put_speedup_vs_mooncake_int32", "get_speedup_vs_mooncake_compact",
                "put_speedup_vs_mooncake"):
        if key in result:
            print(f"  {key} (min over sizes): {result[key]}")
    print(f"  left behind: {result['leftovers']}")
    result["bench"] = "peers_hosts"
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
