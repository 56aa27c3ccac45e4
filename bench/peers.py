"""The same R3 shard put and got through gputq and its peers, each system alone on the machine.

``python -m bench.peers [--sizes 4,16,64,256] [--systems ...] [--json]``;
``python -m bench.peers --summarise LOG [LOG ...]``: median and range over runs.

A shard is ``samples`` routed-expert tensors ``[rows, L, K]`` of int32
(the dtype the trainer receives) holding IDs below ``--experts``, in all
``--sizes`` MiB. Each system stores it (put) and hands it back as int32
arrays (get):

- ``gputq-auto``: the headline. A StorageUnit actor on an embedded Ray,
  read over the transport ``auto`` picks for a reader on the unit's host;
  the writer puts every sample and flushes (put); the reader fetches the
  shard from the call to its return, planning and restore included (get).
  Stored as int32, so nothing is narrowed;
- ``gputq-auto-<compact>``: the same, the writer narrowing the IDs to the
  smallest dtype that holds ``--experts`` (uint8 for 128), as a deployment
  configures it; the put's bytes are still the int32 payload handed over;
- ``gputq-<transport>``: each transport this build serves (shm, rdma where
  NIXL loads, tcp) in its own row, int32;
- ``mooncake``: Mooncake Store (:mod:`bench.mooncake`): its own master, a
  holder process contributing the global segment, the client contributing
  none, ``batch_put_from`` and ``batch_get_into`` over registered buffers;
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
round is freed after its get, outside both timers. Every system's warm-up
get is checked against the shard, value for value.

Ratios (``--json`` keys) are gputq-auto's over each peer's, the smallest
over the shards of ``--goal-min-mib`` and more: ``get_speedup_vs_<peer>``
(int32 stored), ``put_speedup_vs_mooncake`` (the compact row's put, the
narrowing included, over Mooncake's put of the int32 payload), and beside
them the effects apart (``put_speedup_vs_mooncake_int32``,
``get_speedup_vs_mooncake_compact``) and each transport's ratio
(``..._by_transport``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys

import numpy as np

from bench.common import (
    Progress,
    SocketBaseline,
    add_json_flag,
    emit_json,
    gbps,
    print_header,
    print_table,
    trainer_runtime,
    wall_time,
)
from gputq.data.fields import ROUTED_EXPERTS_DTYPES

__all__ = ["available_systems", "compact_dtype", "make_shard", "measure_rounds", "check_same", "speedups", "summarise",
           "run_worker", "main"]

_MIB = 1 << 20
GOAL_MIN_MIB = 16
HEADLINE = "gputq-auto"
PEERS = ("transferqueue", "mooncake", "ray", "socket")


def make_shard(size_mib: float, layers: int, topk: int, rows: int, seed: int = 0,
               experts: int = 128) -> list[np.ndarray]:
    """``ceil(size / sample)`` int32 samples of ``[rows, layers, topk]`` expert IDs below ``experts``."""
    sample = rows * layers * topk * 4
    count = max(1, -(-int(size_mib * _MIB) // sample))
    rng = np.random.default_rng(seed)
    return [rng.integers(0, experts, size=(rows, layers, topk), dtype=np.int32) for _ in range(count)]


def compact_dtype(experts: int) -> str:
    """The smallest stored dtype that holds expert IDs ``0 .. experts - 1``."""
    return next(d for d in ROUTED_EXPERTS_DTYPES if np.iinfo(d).max >= experts - 1)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure_rounds(put, get, drop, check, repeats: int) -> tuple[float, float, float]:
    """Median put and get seconds, and the getting process's minor page faults per get.

    ``repeats`` rounds after a warm-up round. ``put(i)`` stores the shard
    under round ``i``'s keys, ``get(i)`` returns it, ``drop(i)`` frees it;
    dropping is not timed (no system's is). The faults count pages this
    process touched for the first time (fresh or newly mapped memory):
    on a VM each costs as much as copying the page several times.
    """
    put(0)
    check(get(0))
    drop(0)
    puts, gets, faults = [], [], []
    for i in range(1, repeats + 1):
        puts.append(wall_time(lambda: put(i)))
        before = _minor_faults()
        gets.append(wall_time(lambda: get(i)))
        faults.append(_minor_faults() - before)
        drop(i)
    return statistics.median(puts), statistics.median(gets), statistics.median(faults)


def check_same(shard: list[np.ndarray], got) -> None:
    got = [np.asarray(g) for g in got]
    if len(got) != len(shard) or not all(np.array_equal(a, b) for a, b in zip(shard, got)):
        raise AssertionError("a system returned different bytes than it was given")


# -- one function per system; each runs in its own process ---------------------
def _gputq(transport: str, dtype: str, shards: dict, repeats: int) -> dict:
    from gputq.client.reader import Reader
    from gputq.client.writer import Writer
    from gputq.cluster.deploy import Deployment
    from gputq.config import GputqConfig

    biggest = max(sum(a.nbytes for a in s) for s in shards.values())
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, routed_experts_dtype=dtype,
                         transport=transport, num_units=1, unit_capacity_bytes=3 * biggest + 64 * _MIB)
    import ray

    # address="local": our own cluster, never one another job left on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with Deployment.start(config) as deployment:
            config = deployment.config
            with deployment.clients() as clients, Writer(clients, config) as writer, \
                    Reader(clients, config) as reader:
                out, restore = gputq_rounds(writer, reader, deployment, shards, repeats,
                                            lambda size, i, count: [f"{size}/{i}/{j}" for j in range(count)])
                chosen = sorted({clients.transport_of(u)[0] for u in clients.units})
    finally:
        ray.shutdown()
    return {"timings": out, "transport": "+".join(chosen), "restore": restore}


def gputq_rounds(writer, reader, deployment, shards: dict, repeats: int, keys_of) -> tuple[dict, dict]:
    """:func:`measure_rounds` of every shard through gputq: the writer's put + flush, the reader's fetch.

    ``keys_of(size, i, count)`` names round ``i``'s step keys; each round
    is its own partition, released after its get. Returns the timings per
    size and the median seconds of the gets' restores (widening, layer-major
    to token-major; the warm-up round left out) per size.
    """
    from gputq.data.refs import Layout

    out, restores = {}, {}
    for size, shard in shards.items():
        layouts: dict[int, list] = {}

        def put(i):
            refs = [writer.put(key, f"p{size}.{i}", {"routed_experts": a})
                    for key, a in zip(keys_of(size, i, len(shard)), shard)]
            writer.flush()
            layouts[i] = [{"routed_experts": Layout.from_ref(r["routed_experts"])} for r in refs]

        def get(i):
            # One field per sample; the reader names it as the trainer does.
            got = [next(iter(sample.values())) for sample in reader.fetch(layouts[i])]
            restores.setdefault(size, []).append(reader.last_stats.restore_seconds)
            return got

        out[size] = measure_rounds(put, get, lambda i: deployment.release_partition(f"p{size}.{i}"),
                                   lambda got: check_same(shard, got), repeats)
    return out, {size: statistics.median(times[1:]) for size, times in restores.items()}


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

            out[size] = measure_rounds(put, get, lambda i: tq.kv_clear(keys=keys.pop(i), partition_id="bench"),
                                       lambda got: check_same(shard, got), repeats)
    finally:
        tq.close()
        ray.shutdown()
    return {"timings": out}


def _mooncake(shards: dict, repeats: int, batch_keys: int) -> dict:
    from bench.mooncake import MooncakeClient, MooncakeMaster, holder

    biggest = max(sum(a.nbytes for a in s) for s in shards.values())
    out = {}
    # One shard in the segment at a time (each round is removed after its get), twice for slack.
    with MooncakeMaster() as master, holder(master.address, 2 * biggest + 64 * _MIB) as held:
        client = MooncakeClient(master.address, biggest)
        try:
            for size, shard in shards.items():
                spans = client.stage(shard)  # the shard in registered memory, as its users keep it
                keys = {}
                batch = batch_keys or len(shard)

                def put(i):
                    keys[i] = [f"{size}/{i}/{j}" for j in range(len(shard))]
                    client.put(keys[i], spans, batch)

                def get(i):
                    client.get(keys[i], spans, batch)
                    return client.arrays(spans, shard)  # views of the destination, as its users read it

                out[size] = measure_rounds(put, get, lambda i: client.remove(keys.pop(i)),
                                           lambda got: check_same(shard, got), repeats)
        finally:
            client.close()
    return {"timings": out, "pids": {"mooncake_master": master.proc.pid, "mooncake_holder": held.pid}}


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
            out[size] = measure_rounds(lambda i: ray.get(store.put.remote(f"{size}/{i}", shard)),
                                       lambda i: ray.get(store.get.remote(f"{size}/{i}")),
                                       lambda i: ray.get(store.drop.remote(f"{size}/{i}")),
                                       lambda got: check_same(shard, got), repeats)
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
            out[size] = (statistics.median(puts), statistics.median(gets), None)  # the server's faults are not ours
    return {"timings": out}


def _transferqueue_missing() -> str | None:
    try:
        for module in ("tensordict", "transfer_queue"):
            importlib.import_module(module)
    except ImportError as exc:
        return f"{exc}; pip install 'gputq[bench]'"
    return None


def available_systems(experts: int = 128) -> tuple[list[str], dict[str, str]]:
    """Systems this machine can run (gputq's first), and why each peer left out is missing."""
    from bench.mooncake import mooncake_import_error
    from gputq.config import TRANSPORTS
    from gputq.transport.policy import nixl_import_error

    systems = [HEADLINE, f"{HEADLINE}-{compact_dtype(experts)}"]
    systems += [f"gputq-{t}" for t in TRANSPORTS if t != "auto" and (t != "rdma" or nixl_import_error() is None)]
    missing = {"transferqueue": _transferqueue_missing(), "mooncake": mooncake_import_error()}
    systems += [p for p in PEERS if missing.get(p) is None]
    return systems, {p: why for p, why in missing.items() if why is not None}


def _gputq_system(system: str) -> tuple[str, str]:
    """``gputq-<transport>[-<dtype>]`` as (transport, stored dtype)."""
    _, transport, *dtype = system.split("-")
    return transport, (dtype or ["int32"])[0]


#: What carries each peer's bytes here (gputq's rows name the transport their channels chose).
_VIA = {"mooncake": "tcp", "socket": "tcp", "ray": "object store", "transferqueue": "zmq"}


def run_worker(system: str, args) -> dict:
    """Time ``system`` in this process; returns its rows."""
    sizes = [float(s) for s in args.sizes.split(",")]
    shards = {size: make_shard(size, args.layers, args.topk, args.rows, experts=args.experts) for size in sizes}
    if system.startswith("gputq-"):
        trainer_runtime()  # the getting process stands for a trainer, whose torch is loaded
        result = _gputq(*_gputq_system(system), shards, args.repeats)
    elif system == "mooncake":
        result = _mooncake(shards, args.repeats, args.mooncake_batch_keys)
    else:
        result = {"transferqueue": _transferqueue, "ray": _ray, "socket": _socket}[system](shards, args.repeats)
    stored = _gputq_system(system)[1] if system.startswith("gputq-") else "int32"
    via = result.get("transport") or _VIA.get(system, "")
    rows = []
    for size, (put_s, get_s, faults) in result["timings"].items():
        nbytes = sum(a.nbytes for a in shards[size])
        rows.append({"system": system, "via": via, "stored": stored, "shard_MiB": round(nbytes / _MIB, 2),
                     "samples": len(shards[size]),
                     "put_GBps": round(gbps(nbytes, put_s), 3), "get_GBps": round(gbps(nbytes, get_s), 3),
                     "put_ms": round(put_s * 1e3, 2), "get_ms": round(get_s * 1e3, 2)})
        if faults is not None:
            rows[-1]["get_faults_per_MiB"] = round(faults / (nbytes / _MIB), 1)
        if size in result.get("restore", {}):
            rows[-1]["restore_ms"] = round(result["restore"][size] * 1e3, 2)
    return {"system": system, "rows": rows, "pids": result.get("pids", {})}


_WORKER_FLAGS = ("sizes", "repeats", "layers", "topk", "rows", "experts", "mooncake_batch_keys")


def _spawn(system: str, args) -> dict:
    """Run one system in a child process and read its JSON line."""
    cmd = [sys.executable, "-m", "bench.peers", "--worker", system]
    for name in _WORKER_FLAGS:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"system": system, "rows": [], "error": [f"ran past --timeout {args.timeout:.0f} s"]}
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if proc.returncode == 0 and result is not None:
        return result
    status = f"exited with status {proc.returncode}"
    if result is not None:  # it measured and reported, then died on the way out: keep the rows, say so
        return {**result, "warning": f"{status} after reporting its rows"}
    return {"system": system, "rows": [], "error": [status, *proc.stderr.strip().splitlines()[-3:]]}


def _min_ratio(by: dict, sizes: list, system: str, peer: str, op: str) -> float | None:
    ratios = [by[(system, s)][f"{op}_GBps"] / by[(peer, s)][f"{op}_GBps"] for s in sizes
              if (system, s) in by and (peer, s) in by]
    return round(min(ratios), 3) if ratios else None


def speedups(rows: list[dict], systems: list[str], goal_min_mib: float = GOAL_MIN_MIB) -> dict:
    """gputq-auto's over each peer's, the smallest over shards of ``goal_min_mib`` and more.

    ``get_speedup_vs_<peer>`` compares gets of int32-stored shards; beside
    it, ``..._by_transport`` gives every other gputq row's. Against
    Mooncake, ``put_speedup_vs_mooncake`` takes the compact row's put
    (narrowing included) and ``put_speedup_vs_mooncake_int32`` the int32
    one's; ``get_speedup_vs_mooncake_compact`` the compact row's get.
    """
    out = {}
    sizes = sorted({r["shard_MiB"] for r in rows if r["shard_MiB"] >= goal_min_mib})
    by = {(r["system"], r["shard_MiB"]): r for r in rows}
    compact = next((s for s in systems if s.startswith(f"{HEADLINE}-")), None)
    for peer in PEERS:
        headline = _min_ratio(by, sizes, HEADLINE, peer, "get")
        if headline is not None:
            out[f"get_speedup_vs_{peer}"] = headline
        per_transport = {s: _min_ratio(by, sizes, s, peer, "get") for s in systems
                         if s.startswith("gputq-") and not s.startswith(HEADLINE)}
        per_transport = {s: r for s, r in per_transport.items() if r is not None}
        if per_transport:
            out[f"get_speedup_vs_{peer}_by_transport"] = per_transport
    extra = {"put_speedup_vs_mooncake": (compact, "put"), "put_speedup_vs_mooncake_int32": (HEADLINE, "put"),
             "get_speedup_vs_mooncake_compact": (compact, "get")}
    for key, (system, op) in extra.items():
        ratio = _min_ratio(by, sizes, system, "mooncake", op) if system else None
        if ratio is not None:
            out[key] = ratio
    return out


def _median_range(values: list[float]) -> str:
    middle = statistics.median(values)
    return f"{middle:.3g} ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else f"{middle:.3g}"


def summarise(results: list[dict]) -> None:
    """Print the median and range over several runs' JSON results: per row, then per ratio."""
    order = results[0].get("systems") or list(dict.fromkeys(r["system"] for r in results[0]["rows"]))
    keys = sorted({(r["system"], r["shard_MiB"]) for res in results for r in res["rows"]},
                  key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[1]))
    table = []
    for system, mib in keys:
        rows = [r for res in results for r in res["rows"] if (r["system"], r["shard_MiB"]) == (system, mib)]
        shares = [r["restore_ms"] / r["get_ms"] for r in rows if "restore_ms" in r]
        table.append({"system": system, "via": rows[0]["via"], "stored": rows[0]["stored"], "shard_MiB": mib,
                      "put_GBps": _median_range([r["put_GBps"] for r in rows]),
                      "get_GBps": _median_range([r["get_GBps"] for r in rows]),
                      "restore_share": _median_range(shares) if shares else ""})
    print(f"median (range) over {len(results)} runs")
    print_table(table, ["system", "via", "stored", "shard_MiB", "put_GBps", "get_GBps", "restore_share"])
    for key in sorted({k for res in results for k in res if "speedup" in k}):
        if key.endswith("_by_transport"):
            for system in sorted({s for res in results for s in res.get(key, {})}):
                values = [res[key][system] for res in results if system in res.get(key, {})]
                print(f"  {key}[{system}]: {_median_range(values)}")
        else:
            values = [res[key] for res in results if key in res]
            print(f"  {key}: {_median_range(values)}  (runs: {', '.join(f'{v:g}' for v in values)})")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16,64,256", help="shard sizes in MiB, comma separated")
    parser.add_argument("--systems", default=None, help="comma separated; default: every available one")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--experts", type=int, default=128, help="IDs are below this; sets the compact dtype")
    parser.add_argument("--mooncake-batch-keys", type=int, default=0,
                        help="keys per Mooncake batch call (0: the whole shard in one call)")
    parser.add_argument("--goal-min-mib", type=float, default=GOAL_MIN_MIB,
                        help="the ratios take shards of this many MiB and more")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per system")
    parser.add_argument("--plots", default="docs/figures", help="write the PNG here ('' to skip)")
    parser.add_argument("--summarise", nargs="+", metavar="LOG",
                        help="print the median and range over these runs' logs (their last JSON line) and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_json_flag(parser)
    return parser


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.worker:
        emit_json(run_worker(args.worker, args))
        return
    if args.summarise:
        results = []
        for path in args.summarise:
            with open(path, encoding="utf-8") as log:
                results.append(json.loads([line for line in log if line.startswith("{")][-1]))
        summarise(results)
        return
    systems, missing = available_systems(args.experts)
    if args.systems:
        systems = args.systems.split(",")
    else:
        for peer, why in missing.items():
            print(f"{peer} is left out: {why}", file=sys.stderr)
    print_header("R3 shard put/get: gputq vs peers, one system at a time", sizes_MiB=args.sizes,
                 systems=",".join(systems), repeats=args.repeats,
                 sample=f"[{args.rows}, {args.layers}, {args.topk}] int32, IDs < {args.experts}",
                 compact=compact_dtype(args.experts), devices="host memory (numpy), loopback only",
                 mooncake=f"protocol tcp, batch {args.mooncake_batch_keys or 'whole shard'}", cpus=os.cpu_count())
    results = []
    with Progress("bench.peers", len(systems)) as progress:
        for system in systems:
            progress.note(system)
            results.append(_spawn(system, args))
            progress.step(f"{system} done")
    result = _report(results, systems, args.goal_min_mib)
    if args.plots and result["rows"]:
        from bench import plots

        for path in plots.write_figures(plots.peers_figure, result, args.plots):
            print(f"wrote {path}")
    if args.json:
        emit_json(result)


def _report(results: list, systems: list, goal_min_mib: float) -> dict:
    """The systems' rows, failures and speedups, printed; returns the bench's result."""
    rows = [r for res in results for r in res["rows"]]
    print_table(rows, ["system", "via", "stored", "shard_MiB", "samples", "put_GBps", "get_GBps", "put_ms", "get_ms",
                       "restore_ms", "get_faults_per_MiB"])
    for res in results:
        if "error" in res:
            print(f"  {res['system']} failed: {' | '.join(res['error'])}")
        if "warning" in res:
            print(f"  {res['system']}: {res['warning']}")
    summary = speedups(rows, systems, goal_min_mib)
    for key, value in summary.items():
        if not key.endswith("_by_transport"):
            print(f"  {key} (shards >= {goal_min_mib:g} MiB, min over sizes): {value}")
    return {"bench": "peers", "rows": rows, "systems": systems, **summary,
            "pids": {r["system"]: r["pids"] for r in results if r.get("pids")},
            "errors": {r["system"]: r["error"] for r in results if "error" in r},
            "warnings": {r["system"]: r["warning"] for r in results if "warning" in r}}


if __name__ == "__main__":
    main()
