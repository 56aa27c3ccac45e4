"""The same R3 shard put and got through gputq and its peers, each system alone on the machine.

``python -m bench.peers [--sizes 4,16,64,256] [--systems ...] [--json]``

A shard is ``samples`` routed-expert tensors ``[rows, L, K]`` of int32
(the dtype the trainer receives, so no system converts anything), in all
``--sizes`` MiB. Each system stores it (put) and hands it back as arrays
(get):

- ``gputq-<transport>``: a StorageUnit actor on an embedded Ray; the writer
  puts every sample and flushes (put); the reader fetches the shard from
  the call to its return, planning and restore included (get). One
  system per transport this build serves (tcp, rdma where NIXL loads, shm
  where present);
- ``transferqueue``: the ``transferqueue`` package (0.1.11) with its
  default storage (SimpleStorage), ``kv_batch_put`` of one TensorDict and
  ``kv_batch_get`` of its keys; Ray declares 3 CPUs, as it needs;
- ``ray``: a Ray actor that keeps the arrays it is sent and returns them;
- ``socket``: a plain socket to a server in a child process (the floor).

Every system runs in its own child process (this module with
``--worker``), and nothing of one system is alive while another is
timed: on a 2-core machine background threads left behind by one system
cut another's throughput several times over. Times are medians of
``--repeats`` after one warm-up; each put goes to fresh keys, and the
round is freed after its get, outside both timers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from bench.common import Progress, SocketBaseline, add_json_flag, emit_json, gbps, print_header, print_table

__all__ = ["available_systems", "make_shard", "main"]

_MIB = 1 << 20
GOAL_MIN_MIB = 16


def make_shard(size_mib: float, layers: int, topk: int, rows: int, seed: int = 0) -> list[np.ndarray]:
    """``ceil(size / sample)`` int32 samples of ``[rows, layers, topk]`` expert IDs."""
    sample = rows * layers * topk * 4
    count = max(1, -(-int(size_mib * _MIB) // sample))
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, size=(rows, layers, topk), dtype=np.int32) for _ in range(count)]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(put, get, drop, check, repeats: int) -> tuple[float, float]:
    """Median put and get seconds over ``repeats`` rounds after a warm-up round.

    ``put(i)`` stores the shard under round ``i``'s keys, ``get(i)`` returns
    it, ``drop(i)`` frees it; dropping is not timed (no system's is).
    """
    put(0)
    check(get(0))
    drop(0)
    puts, gets = [], []
    for i in range(1, repeats + 1):
        puts.append(_timed(lambda: put(i)))
        gets.append(_timed(lambda: get(i)))
        drop(i)
    return statistics.median(puts), statistics.median(gets)


def _same(shard: list[np.ndarray], got) -> None:
    got = [np.asarray(g) for g in got]
    if len(got) != len(shard) or not all(np.array_equal(a, b) for a, b in zip(shard, got)):
        raise AssertionError("a system returned different bytes than it was given")


# -- one function per system; each runs in its own process ---------------------
def _gputq(transport: str, shards: dict, repeats: int) -> dict:
    from gputq.client.reader import Reader
    from gputq.client.writer import Writer
    from gputq.cluster.deploy import Deployment
    from gputq.config import GputqConfig
    from gputq.data.refs import Layout

    biggest = max(sum(a.nbytes for a in s) for s in shards.values())
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, routed_experts_dtype="int32",
                         transport=transport, num_units=1, unit_capacity_bytes=3 * biggest + 64 * _MIB)
    out = {}
    import ray

    # address="local": our own cluster, never one another job left on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with Deployment.start(config) as deployment:
            config = deployment.config
            with deployment.clients() as clients, Writer(clients, config) as writer, \
                    Reader(clients, config) as reader:
                for size, shard in shards.items():
                    layouts: dict[int, list] = {}

                    def put(i):
                        refs = [writer.put(f"{size}/{i}/{j}", f"p{size}.{i}", {"routed_experts": a})
                                for j, a in enumerate(shard)]
                        writer.flush()
                        layouts[i] = [{"routed_experts": Layout.from_ref(r["routed_experts"])} for r in refs]

                    def get(i):
                        # One field per sample; the reader names it as the trainer does.
                        return [next(iter(sample.values())) for sample in reader.fetch(layouts[i])]

                    out[size] = _measure(put, get, lambda i: deployment.release_partition(f"p{size}.{i}"),
                                         lambda got: _same(shard, got), repeats)
                chosen = sorted({clients.transport_of(u)[0] for u in clients.units})
    finally:
        ray.shutdown()
    return {"timings": out, "transport": "+".join(chosen)}


def _transferqueue(shards: dict, repeats: int) -> dict:
    import ray
    import torch
    from tensordict import TensorDict

    # TransferQueue's controller and storage actors each take a CPU: with fewer
    # than 3 declared, its init waits forever for a slot.
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    import transfer_queue as tq

    tq.init()
    out = {}
    try:
        for size, shard in shards.items():
            batch = TensorDict({"routed_experts": torch.from_numpy(np.stack(shard))}, batch_size=len(shard))
            keys = {}

            def put(i):
                keys[i] = [f"{size}/{i}/{j}" for j in range(len(shard))]
                tq.kv_batch_put(keys=keys[i], partition_id="bench", fields=batch)

            def get(i):
                got = tq.kv_batch_get(keys=keys[i], partition_id="bench")["routed_experts"]
                return [t.numpy() for t in got.unbind()]  # samples as arrays, as the others return

            out[size] = _measure(put, get, lambda i: tq.kv_clear(keys=keys.pop(i), partition_id="bench"),
                                 lambda got: _same(shard, got), repeats)
    finally:
        tq.close()
        ray.shutdown()
    return {"timings": out}


class _ArrayStore:
    """The Ray baseline: an actor that keeps what it is sent and returns it."""

    def __init__(self):
        self._data = {}

    def put(self, key, arrays) -> int:
        self._data[key] = arrays
        return len(arrays)

    def get(self, key):
        return self._data[key]

    def drop(self, key) -> None:
        self._data.pop(key, None)


def _ray(shards: dict, repeats: int) -> dict:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    store = ray.remote(num_cpus=0)(_ArrayStore).remote()
    out = {}
    try:
        for size, shard in shards.items():
            out[size] = _measure(lambda i: ray.get(store.put.remote(f"{size}/{i}", shard)),
                                 lambda i: ray.get(store.get.remote(f"{size}/{i}")),
                                 lambda i: ray.get(store.drop.remote(f"{size}/{i}")),
                                 lambda got: _same(shard, got), repeats)
    finally:
        ray.shutdown()
    return {"timings": out}


def _socket(shards: dict, repeats: int) -> dict:
    biggest = max(sum(a.nbytes for a in s) for s in shards.values())
    out = {}
    with SocketBaseline(biggest) as sock:
        for size, shard in shards.items():
            nbytes = sum(a.nbytes for a in shard)
            sock.write(nbytes)
            sock.read(nbytes)
            puts = [sock.write(nbytes) for _ in range(repeats)]
            gets = [sock.read(nbytes) for _ in range(repeats)]
            out[size] = (statistics.median(puts), statistics.median(gets))
    return {"timings": out}


def available_systems() -> list[str]:
    """Systems this machine can run, gputq's transports first."""
    from gputq.config import TRANSPORTS
    from gputq.transport.policy import nixl_import_error

    systems = [f"gputq-{t}" for t in TRANSPORTS if t != "auto" and (t != "rdma" or nixl_import_error() is None)]
    try:
        import tensordict  # noqa: F401
        import transfer_queue  # noqa: F401

        systems.append("transferqueue")
    except ImportError:
        pass
    return systems + ["ray", "socket"]


def run_worker(system: str, args) -> dict:
    """Time ``system`` in this process; returns its rows."""
    sizes = [float(s) for s in args.sizes.split(",")]
    shards = {size: make_shard(size, args.layers, args.topk, args.rows) for size in sizes}
    if system.startswith("gputq-"):
        result = _gputq(system.split("-", 1)[1], shards, args.repeats)
    else:
        result = {"transferqueue": _transferqueue, "ray": _ray, "socket": _socket}[system](shards, args.repeats)
    rows = []
    for size, (put_s, get_s) in result["timings"].items():
        nbytes = sum(a.nbytes for a in shards[size])
        rows.append({"system": system, "shard_MiB": round(nbytes / _MIB, 2), "samples": len(shards[size]),
                     "put_GBps": round(gbps(nbytes, put_s), 3), "get_GBps": round(gbps(nbytes, get_s), 3),
                     "put_ms": round(put_s * 1e3, 2), "get_ms": round(get_s * 1e3, 2)})
    return {"system": system, "rows": rows, "transport": result.get("transport")}


def _spawn(system: str, args) -> dict:
    """Run one system in a child process and read its JSON line."""
    cmd = [sys.executable, "-m", "bench.peers", "--worker", system, "--sizes", args.sizes,
           "--repeats", str(args.repeats), "--layers", str(args.layers), "--topk", str(args.topk),
           "--rows", str(args.rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        return {"system": system, "rows": [], "error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def speedups(rows: list[dict], systems: list[str]) -> dict:
    """gputq's get over each peer's, per size >= 16 MiB: the smallest, per gputq transport and overall."""
    out = {}
    sizes = sorted({r["shard_MiB"] for r in rows if r["shard_MiB"] >= GOAL_MIN_MIB})
    by = {(r["system"], r["shard_MiB"]): r for r in rows}
    for peer in ("transferqueue", "ray", "socket"):
        per_transport = {}
        for system in (s for s in systems if s.startswith("gputq-")):
            ratios = [by[(system, s)]["get_GBps"] / by[(peer, s)]["get_GBps"] for s in sizes
                      if (system, s) in by and (peer, s) in by]
            if ratios:
                per_transport[system] = round(min(ratios), 3)
        if per_transport:
            # The headline uses the transport auto would pick on one host: the best this build serves.
            out[f"get_speedup_vs_{peer}"] = max(per_transport.values())
            out[f"get_speedup_vs_{peer}_by_transport"] = per_transport
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16,64,256", help="shard sizes in MiB, comma separated")
    parser.add_argument("--systems", default=None, help="comma separated; default: every available one")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per system")
    parser.add_argument("--plots", default="docs/figures", help="write the PNG here ('' to skip)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.worker:
        emit_json(run_worker(args.worker, args))
        return
    systems = args.systems.split(",") if args.systems else available_systems()
    if "transferqueue" not in systems and not args.systems:
        print("transferqueue is not installed, so it is left out: pip install 'gputq[bench]'", file=sys.stderr)
    print_header("R3 shard put/get: gputq vs peers, one system at a time", sizes_MiB=args.sizes,
                 systems=",".join(systems), repeats=args.repeats,
                 sample=f"[{args.rows}, {args.layers}, {args.topk}] int32", cpus=os.cpu_count())
    results = []
    with Progress("bench.peers", len(systems)) as progress:
        for system in systems:
            progress.note(system)
            results.append(_spawn(system, args))
            progress.step(f"{system} done")
    rows = [r for res in results for r in res["rows"]]
    print_table(rows, ["system", "shard_MiB", "samples", "put_GBps", "get_GBps", "put_ms", "get_ms"])
    for res in results:
        if "error" in res:
            print(f"  {res['system']} failed: {res['error'][-1]}")
    summary = speedups(rows, systems)
    for key, value in summary.items():
        if not key.endswith("_by_transport"):
            print(f"  {key} (shards >= {GOAL_MIN_MIB} MiB, min over sizes): {value}")
    result = {"bench": "peers", "rows": rows, "systems": systems, **summary,
              "errors": {r["system"]: r["error"] for r in results if "error" in r}}
    if args.plots and rows:
        from bench import plots

        for path in plots.write_figures(plots.peers_figure, result, args.plots):
            print(f"wrote {path}")
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
