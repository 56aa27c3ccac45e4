"""The master node's trajectory memory, with and without gputq, measured per process over time.

``python -m bench.memory [--units 2,4,8] [--dtypes int32,uint16,uint8] [--scale 1] [--hosts N] [--json]``

The same seeded synthetic rollout runs through two paths on Ray:

- **centralised**: segments carry their fields inline (int32 IDs). A proxy
  actor sends each session's segments to a rollout-manager actor, which
  holds the batch (a private copy, as samples arriving over HTTP would be);
  the manager splits it per data-parallel rank with ``ray.put`` and the
  trainer actors ``ray.get`` their parts.
- **gputq**: the proxy actor is the writer: it puts each step's fields into
  N StorageUnits and sends lightweight samples (layouts) to the manager,
  which splits them the same way; trainers fetch their shards from the
  units and restore them.

Without ``--hosts`` one machine stands in for N nodes: one embedded Ray,
N unit actors, unit 0 counted as the master's own. With ``--hosts N`` the
run is on N hosts built on this machine (``bench.hosts``: a network
namespace, address, hostname and /dev/shm each, a Ray node each): the
proxy, the rollout manager, the controller and unit 0 on host 0, the
master; unit i on host i (cluster mode, one unit per node); the trainers
on the other hosts. The master's object store is host 0's.

A sampler thread (``bench.memsample``) reads ``/proc/<pid>/smaps`` of every
component process and the master's object store every ``--interval``
seconds. The master total is proxy + rollout manager + object store +
controller + unit 0, summed per sample, its peak taken over time; the
figures are above each process's idle baseline (``raw`` ones include it).

Arenas, two ways:

- **sized** to the run: each unit's capacity is the busiest unit's stored
  bytes (placement is known before writing) plus 2% and 1 MiB, so the
  master's unit holds about 1/N of the payload;
- **fixed**, as a deployment sets it before it knows the run: every unit
  gets ``--fixed-capacity-mib`` (default: the config's own default), and
  the master's unit costs all of it, full or not (run at the smallest N).

Ratios, each against the centralised master peak unless named otherwise:
``master_peak_ratio_int32`` is the offload effect alone (2 units, int32);
``narrowing`` is each compact dtype's peak over int32's at the same N;
``master_peak_ratio`` (2 units, uint16) has both.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from bench.common import (
    Progress,
    add_json_flag,
    add_rollout_flags,
    digest,
    emit_json,
    print_header,
    print_table,
    synthetic_config,
)
from bench.memsample import MemorySampler, summarise

__all__ = ["MASTER", "Rollout", "rollout_plan", "calibration", "host_shares", "run", "main"]

MASTER = ("proxy", "rollout_manager", "object_store", "controller", "su-0")
_MIB = 1 << 20


# -- the rollout ---------------------------------------------------------------
@dataclass(frozen=True)
class Rollout:
    """The synthetic rollout both paths carry: ``sessions`` independent sessions."""

    sessions: int
    synth: object  # SyntheticConfig of one session; session s uses seed base + s

    def session_config(self, s: int):
        return replace(self.synth, seed=self.synth.seed * 100003 + s)


def _partition(run: str, s: int) -> str:
    return f"{run}.s{s}"


def rollout_plan(rollout: Rollout, units: list[str], dtype: str, run: str = "r") -> dict:
    """Bytes the rollout makes: int32 R3 bytes carried, and stored bytes per unit for ``dtype``.

    Placement is a pure function of the key, so the arenas can be sized
    before anything is written.
    """
    from gputq.client.placement import rendezvous_unit
    from gputq.data.keys import step_key
    from gputq.tools.synthetic import generate_calls

    from gputq.data.fields import routed_experts_spec, row_nbytes

    synth = rollout.synth
    row_bytes = row_nbytes(routed_experts_spec(synth.layers, synth.topk, dtype, synth.num_experts))
    per_unit = dict.fromkeys(units, 0)
    r3_int32 = 0
    for s in range(rollout.sessions):
        for call in generate_calls(rollout.session_config(s)):
            experts = call.engine_output["meta_info"]["routed_experts"]
            logprobs = call.engine_output["meta_info"]["output_token_logprobs"]
            r3_int32 += experts.size * 4
            unit = rendezvous_unit(step_key(_partition(run, s), call.session_id, call.step_index), units)
            # Blocks are 256-byte aligned in the arena.
            per_unit[unit] += -(-len(experts) * row_bytes // 256) * 256 + -(-logprobs.nbytes // 256) * 256
    return {"r3_int32": r3_int32, "per_unit": per_unit}


class Proxy:
    """The rollout side: turns engine outputs into samples and sends them to the manager."""

    def pid(self) -> int:
        return os.getpid()

    def centralised(self, manager, rollout: Rollout) -> int:
        """Send each session's segments with their fields inline; returns bytes sent."""
        import ray

        from gputq.data.fields import FieldRegistry
        from gputq.data.trajectory import inline_fields, lineage_segments
        from gputq.tools.synthetic import build_sessions

        fields = FieldRegistry.builtin(rollout.synth.layers, rollout.synth.topk)
        sent = 0
        for s in range(rollout.sessions):
            sessions = build_sessions(rollout.session_config(s), fields=fields, inline=True)
            fat = [{"id": f"{s}/{seg.segment_id}", "tokens": seg.tokens, "fields": inline_fields(seg)}
                   for session in sessions for seg in lineage_segments(session)]
            sent += sum(a.nbytes for item in fat for a in item["fields"].values())
            ray.get(manager.submit.remote(fat))
            del sessions, fat
        return sent

    def gputq(self, manager, rollout: Rollout, membership: dict, config, run: str) -> int:
        """Write each session's fields to the units, send lightweight samples; returns bytes written."""
        import ray

        from gputq.client.clients import UnitClients
        from gputq.client.writer import Writer
        from gputq.data.trajectory import lineage_segments
        from gputq.tools.synthetic import build_sessions

        fields = config.field_registry(rollout.synth.layers, rollout.synth.topk)
        with UnitClients(membership, config) as clients, Writer(clients, config) as writer:
            for s in range(rollout.sessions):
                partition = _partition(run, s)
                sessions = build_sessions(rollout.session_config(s), fields=fields, writer=writer,
                                          partition=partition, inline=False)
                segments = [seg for session in sessions for seg in lineage_segments(session)]
                writer.finalize([seg.layouts for seg in segments], partition)
                ray.get(manager.submit.remote([{"id": f"{s}/{seg.segment_id}", "sample": seg.to_sample()}
                                               for seg in segments]))
            writer.flush()
            return writer.bytes_written


class Manager:
    """The rollout manager: holds the batch, splits it per rank with ``ray.put``."""

    def __init__(self):
        self._batch: list[dict] = []
        self._parts: list = []

    def pid(self) -> int:
        return os.getpid()

    def submit(self, items: list[dict]) -> int:
        for item in items:
            if "fields" in item:
                # Samples reach a real manager over HTTP: its own heap copy, not views that
                # would pin the call's argument in the object store.
                item = {**item, "tokens": np.array(item["tokens"], copy=True),
                        "fields": {k: np.array(v, copy=True) for k, v in item["fields"].items()}}
            self._batch.append(item)
        return len(self._batch)

    def split(self, world: int) -> list:
        import ray

        self._parts = [ray.put(self._batch[rank::world]) for rank in range(world)]
        return self._parts

    def clear(self) -> None:
        self._batch, self._parts = [], []
        gc.collect()


class Trainer:
    """One data-parallel rank: gets its part, restores (gputq) or reads (centralised) the fields."""

    def __init__(self, membership: dict | None = None, config=None):
        self._reader = self._clients = None
        if membership is not None:
            from gputq.client.clients import UnitClients
            from gputq.client.reader import Reader

            self._clients = UnitClients(membership, config)
            self._reader = Reader(self._clients, config)

    def pid(self) -> int:
        return os.getpid()

    def train(self, parts: list, rank: int) -> dict:
        import ray

        items = ray.get(parts[rank])
        if self._reader is None:
            out = {item["id"]: digest(item["fields"]) for item in items}
        else:
            from gputq.data.trajectory import Segment

            restored = self._reader.fetch([Segment.from_sample(item["sample"]).layouts for item in items])
            out = {item["id"]: digest(fields) for item, fields in zip(items, restored)}
        del items
        gc.collect()
        return out

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._clients.close()


# -- one run of each path ----------------------------------------------------
def _actor(ray, cls, *args, host: str | None = None):
    """A serving actor (num_cpus=0), pinned to namespace host ``host`` (its ``host<i>`` resource) if given."""
    options = {"resources": {host: 0.01}} if host else {}
    return ray.remote(num_cpus=0, max_concurrency=2)(cls).options(**options).remote(*args)


def _master_host(args) -> str | None:
    return "host0" if args.hosts else None


def _trainer_host(args, rank: int) -> str | None:
    """Trainers run off the master: round-robin over hosts 1..N-1 (anywhere on one machine)."""
    return f"host{1 + rank % (args.hosts - 1)}" if args.hosts else None


def _measure(pids: dict, args, work) -> tuple[dict, object]:
    """Sample ``pids`` while ``work(sampler)`` runs; an idle second first sets each baseline."""
    sampler = MemorySampler(pids, args.interval).start()
    time.sleep(args.idle)  # the idle window the baselines come from
    baseline_until = sampler.now()
    sampler.mark("start")
    try:
        result = work(sampler)
        sampler.mark("done")
        time.sleep(3 * args.interval)
    finally:
        sampler.stop()
    return summarise(sampler, list(pids) + ["object_store"], baseline_until, MASTER), result


def _train(ray, manager, trainers, sampler) -> dict:
    """Split the held batch per rank, have every rank take its part; the restored digests."""
    parts = ray.get(manager.split.remote(len(trainers)))
    sampler.mark("split")
    digests = {}
    for d in ray.get([t.train.remote(parts, r) for r, t in enumerate(trainers)]):
        digests.update(d)
    sampler.mark("trained")
    del parts  # this driver's references would keep the parts in the store
    ray.get(manager.clear.remote())
    return digests


def run_centralised(ray, rollout: Rollout, args) -> tuple[dict, dict]:
    proxy, manager = (_actor(ray, cls, host=_master_host(args)) for cls in (Proxy, Manager))
    trainers = [_actor(ray, Trainer, host=_trainer_host(args, r)) for r in range(args.ranks)]
    pids = dict(zip(["proxy", "rollout_manager"], ray.get([proxy.pid.remote(), manager.pid.remote()])))

    def work(sampler):
        ray.get(proxy.centralised.remote(manager, rollout))
        sampler.mark("batch held")
        return _train(ray, manager, trainers, sampler)

    try:
        return _measure(pids, args, work)
    finally:
        for actor in [proxy, manager, *trainers]:
            ray.kill(actor)


def _unit_names(ray, args, units: int) -> dict[str, str]:
    """Each unit's name in the deployment mapped to its label here (``su-<i>``: unit i, on host i with hosts)."""
    if not args.hosts:
        return {f"su-{i}": f"su-{i}" for i in range(units)}
    from gputq.cluster.deploy import node_unit_name

    host_of = {i: n for n in ray.nodes() if n.get("Alive") for i in range(args.hosts)
               if f"host{i}" in n.get("Resources", {})}
    return {node_unit_name(host_of[i]): f"su-{i}" for i in range(args.hosts)}


def run_gputq(ray, rollout: Rollout, units: int, dtype: str, args, run: str, arena: str) -> tuple[dict, dict]:
    from gputq.cluster.deploy import Deployment
    from gputq.config import GputqConfig

    labels = _unit_names(ray, args, units)
    plan = rollout_plan(rollout, list(labels), dtype, run)
    capacity = (args.fixed_capacity_mib * _MIB if arena == "fixed"
                else int(max(plan["per_unit"].values()) * 1.02) + _MIB)
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, routed_experts_dtype=dtype,
                         num_experts=rollout.synth.num_experts, transport=args.transport, num_units=units,
                         unit_capacity_bytes=capacity)
    with Deployment.start(config, per_node=bool(args.hosts)) as deployment:
        config = deployment.config
        membership = deployment.membership()
        proxy, manager = (_actor(ray, cls, host=_master_host(args)) for cls in (Proxy, Manager))
        trainers = [_actor(ray, Trainer, membership, config, host=_trainer_host(args, r)) for r in range(args.ranks)]
        handles = {"proxy": proxy, "rollout_manager": manager, "controller": deployment.controller,
                   **{labels[name]: handle for name, handle in deployment.units.items()}}
        getpid = lambda self: os.getpid()  # noqa: E731 -- runs inside each actor
        pids = dict(zip(handles, ray.get([h.__ray_call__.remote(getpid) for h in handles.values()])))

        def work(sampler):
            written = ray.get(proxy.gputq.remote(manager, rollout, membership, config, run))
            sampler.mark("batch held")
            digests = _train(ray, manager, trainers, sampler)
            for s in range(rollout.sessions):
                deployment.release_partition(_partition(run, s))
            return {"digests": digests, "written": written}

        try:
            summary, result = _measure(pids, args, work)
        finally:
            ray.get([t.close.remote() for t in trainers])
            for actor in [proxy, manager, *trainers]:
                ray.kill(actor)
    summary["capacity_per_unit"] = capacity
    summary["stored_per_unit"] = {labels[name]: n for name, n in plan["per_unit"].items()}
    return summary, result


# -- the sweep ----------------------------------------------------------------
def _row(run: dict, central: dict, int32: dict | None) -> dict:
    comp = run["components"]
    row = {"path": run["path"], "units": run["units"] or "-", "dtype": run["dtype"], "arena": run["arena"],
           **{name: round(comp[name]["data"] / _MIB, 1) for name in MASTER if name in comp},
           "master_MiB": round(run["master_data"] / _MIB, 1),
           "master_raw_MiB": round(run["master_raw"] / _MIB, 1)}
    if run is not central:
        row["ratio"] = round(run["master_data"] / central["master_data"], 3)
        row["raw_ratio"] = round(run["master_raw"] / central["master_raw"], 3)
    if int32 is not None and run["dtype"] != "int32":
        row["vs_int32"] = round(run["master_data"] / int32["master_data"], 3)
    return row


def calibration(r3_int32: int, central: dict, runs: list[dict]) -> dict:
    """Bytes per R3 byte for ``gputq capacity``: centralised, gputq residual, local unit per stored byte."""
    gputq = [r for r in runs if r["path"] == "gputq" and r["arena"] == "sized"]
    residual = [(r["master_data"] - r["components"]["su-0"]["data"]) / r3_int32 for r in gputq]
    local = [r["components"]["su-0"]["data"] / (r["stored_bytes"] / r["units"]) for r in gputq]
    return {"centralised": central["master_data"] / r3_int32, "residual": statistics.median(residual),
            "local_unit": statistics.median(local), "r3_int32_bytes": r3_int32}


def host_shares(runs: list[dict], central: dict, hosts: int) -> dict:
    """Per dtype, the master's unit's share of what all units hold (memory and stored bytes) against 1/N."""
    out = {"n": hosts, "ideal_share": 1 / hosts, "dtypes": {}}
    for r in runs:
        if r["path"] != "gputq":
            continue
        units = [n for n in r["components"] if n.startswith("su-")]
        share = r["components"]["su-0"]["data"] / sum(r["components"][n]["data"] for n in units)
        stored = r["stored_per_unit"]["su-0"] / sum(r["stored_per_unit"].values())
        out["dtypes"][r["dtype"]] = {
            "local_unit_share": share, "stored_share": stored, "within_10pct": abs(share * hosts - 1) <= 0.10,
            "stored_within_10pct": abs(stored * hosts - 1) <= 0.10,
            "local_unit_of_central": r["components"]["su-0"]["data"] / central["master_data"],
            "ratio": r["master_data"] / central["master_data"]}
    return out


def _rollout(args) -> Rollout:
    return Rollout(sessions=max(1, int(round(args.sessions * args.scale))), synth=synthetic_config(args, 1))


def _store_bytes(r3_int32: int) -> int:
    """The object store: room for the centralised batch several times over (its parts, the calls' arguments)."""
    return int(max(4 * r3_int32, 256 * _MIB))


def _sweep(args) -> list[tuple[int, str, str]]:
    """(units, dtype, arena) of every gputq run, in order."""
    units = [args.hosts] if args.hosts else [int(u) for u in args.units.split(",")]
    dtypes = args.dtypes.split(",")
    sweep = [(n, d, "sized") for n in units for d in dtypes]
    if args.fixed_capacity_mib and not args.hosts:
        sweep += [(min(units), d, "fixed") for d in dtypes]
    return sweep


def _runs(ray, rollout: Rollout, sweep: list, args) -> list[dict]:
    """The centralised path, then gputq at each configuration of ``sweep``, each checked against it."""
    runs = []
    with Progress("bench.memory", 1 + len(sweep)) as progress:
        progress.note("centralised")
        central, central_digests = run_centralised(ray, rollout, args)
        central.update(path="centralised", units=0, dtype="int32", arena="-", stored_bytes=0)
        runs.append(central)
        progress.step("centralised done")
        for n, dtype, arena in sweep:
            progress.note(f"gputq {n} units {dtype} {arena}")
            summary, result = run_gputq(ray, rollout, n, dtype, args, f"n{n}{dtype}{arena}", arena)
            summary.update(path="gputq", units=n, dtype=dtype, arena=arena, stored_bytes=result["written"],
                           verified=result["digests"] == central_digests)
            runs.append(summary)
            progress.step(f"gputq {n} units {dtype} {arena}: master {summary['master_data'] / _MIB:.0f} MiB")
    return runs


def run(args) -> dict:
    """Both paths, every configuration of the sweep; figures and ratios (see the module's docstring)."""
    from gputq.cluster.names import import_ray

    ray = import_ray()
    rollout = _rollout(args)
    r3_int32 = rollout_plan(rollout, ["su-0"], "int32")["r3_int32"]
    if args.ray_address:  # a cluster of namespace hosts, this process on host 0
        ray.init(address=args.ray_address, log_to_driver=False)
        from bench.hosts import wait_nodes

        wait_nodes(ray, args.hosts, 120)
    else:  # address="local": a new cluster of our own, never one another job left on this machine.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=_store_bytes(r3_int32))
    sweep = _sweep(args)
    try:
        runs = _runs(ray, rollout, sweep, args)
    finally:
        ray.shutdown()
    central = runs[0]
    by = {(r["units"], r["dtype"], r["arena"]): r for r in runs[1:]}
    rows = [_row(r, central, by.get((r["units"], "int32", r["arena"]))) for r in runs]
    n0 = 2 if any(n == 2 for n, _, _ in sweep) else sweep[0][0]
    headline = by.get((n0, "uint16", "sized")) or runs[-1]
    int32 = by.get((n0, "int32", "sized"))
    result = {
        "bench": "memory",
        "rows": rows,
        "r3_int32_bytes": r3_int32,
        "master_peak_ratio": headline["master_data"] / central["master_data"],
        "master_peak_ratio_raw": headline["master_raw"] / central["master_raw"],
        "master_peak_ratio_int32": int32["master_data"] / central["master_data"] if int32 else None,
        "narrowing": {d: by[(n0, d, "sized")]["master_data"] / int32["master_data"]
                      for d in ("uint16", "uint8") if int32 and (n0, d, "sized") in by},
        "fixed": {"capacity_MiB": args.fixed_capacity_mib,
                  **{f"master_peak_ratio_{d}": r["master_data"] / central["master_data"]
                     for (n, d, arena), r in by.items() if arena == "fixed"}},
        "headline": {"units": headline["units"], "dtype": headline["dtype"]},
        "verified": all(r.get("verified", True) for r in runs),
        "calibration": calibration(r3_int32, central, runs),
        "runs": runs,
        "config": {"sessions": rollout.sessions, "steps": args.steps, "tokens": args.tokens, "layers": args.layers,
                   "topk": args.topk, "ranks": args.ranks, "interval_s": args.interval,
                   "transport": args.transport, "hosts": args.hosts},
    }
    if args.hosts:
        result["hosts"] = host_shares(runs, central, args.hosts)
    return result


def _on_hosts(args, argv: list[str]) -> dict | None:
    """Build ``args.hosts`` hosts, run this benchmark's job on host 0, tear them down; its result (None: skipped)."""
    from bench.hosts import bench_on_hosts

    r3_int32 = rollout_plan(_rollout(args), ["su-0"], "int32")["r3_int32"]
    store = _store_bytes(r3_int32)
    # Each host's /dev/shm holds its object store and its unit's arena (tmpfs: only written pages count).
    return bench_on_hosts("memory", args.hosts, argv, json_line=args.json, limit_s=args.limit_s,
                          shm_bytes=store + r3_int32 + 256 * _MIB, object_store_bytes=store)


def _print(result: dict) -> None:
    columns = ["path", "units", "dtype", "arena", *MASTER, "master_MiB", "master_raw_MiB", "ratio", "raw_ratio",
               "vs_int32"]
    print_table(result["rows"], columns)
    cal = result["calibration"]
    head = result["headline"]
    int32 = result["master_peak_ratio_int32"]
    print(f"R3 carried (int32): {result['r3_int32_bytes'] / _MIB:.1f} MiB; master peak ratio "
          f"({head['units']} units, {head['dtype']}): {result['master_peak_ratio']:.3f} "
          f"(raw {result['master_peak_ratio_raw']:.3f}); verified {result['verified']}")
    narrowing = ", ".join(f"{d} {v:.3f}" for d, v in result["narrowing"].items())
    print(f"offload alone (int32): {int32:.3f}" if int32 is not None else "offload alone: no int32 run",
          f"; narrowing over int32: {narrowing or '-'}", sep="")
    fixed = {k: v for k, v in result["fixed"].items() if k.startswith("master_peak_ratio_")}
    if fixed:
        print(f"fixed arenas ({result['fixed']['capacity_MiB']} MiB a unit): " +
              ", ".join(f"{k.rsplit('_', 1)[1]} {v:.3f}" for k, v in fixed.items()))
    print(f"calibration per R3 byte: centralised {cal['centralised']:.3f}, gputq residual "
          f"{cal['residual']:.4f}, local unit per stored byte {cal['local_unit']:.3f}")
    if "hosts" in result:
        hosts = result["hosts"]
        print(f"on {hosts['n']} hosts: the master's unit's share against 1/N = {hosts['ideal_share']:.3f}")
        print_table([{"dtype": d, **{k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()}}
                     for d, f in hosts["dtypes"].items()],
                    ["dtype", "local_unit_share", "within_10pct", "stored_share", "stored_within_10pct",
                     "local_unit_of_central", "ratio"])
        print(f"teardown left behind: {result['leftovers']}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--units", default="2,4,8", help="StorageUnit counts N to sweep (one machine)")
    parser.add_argument("--hosts", type=int, default=0,
                        help="run on N namespace hosts, a unit on each (needs root); --units is then N")
    parser.add_argument("--dtypes", default="int32,uint16,uint8",
                        help="stored expert-ID formats to sweep (packed: at the bits --experts needs)")
    parser.add_argument("--fixed-capacity-mib", type=int, default=None,
                        help="every unit's arena in the fixed-capacity runs; 0 skips them "
                             "(default: the config's unit_capacity_bytes)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of sessions")
    add_rollout_flags(parser, sessions=48, steps=4, tokens=640)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="tcp")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("--idle", type=float, default=1.0, help="idle seconds sampled for each baseline")
    parser.add_argument("--plots", default=None,
                        help="write PNGs here ('' to skip; default docs/figures on one machine, none with --hosts)")
    parser.add_argument("--json-compact", action="store_true", help="leave timelines out of the JSON line")
    parser.add_argument("--limit-s", type=float, default=1200, help="the job's wall-clock limit with --hosts")
    parser.add_argument("--ray-address", help=argparse.SUPPRESS)  # set for the job on host 0
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.fixed_capacity_mib is None:
        from gputq.config import GputqConfig

        args.fixed_capacity_mib = GputqConfig().unit_capacity_bytes // _MIB
    if args.hosts == 1:
        parser.error("--hosts must be at least 2 (host 0 is the master)")
    if args.ray_address:
        emit_json(run(args))
        return
    print_header("master-node memory: centralised vs gputq", sessions=round(args.sessions * args.scale),
                 steps=args.steps, tokens=args.tokens, row=f"L={args.layers} K={args.topk}",
                 units=args.hosts or args.units, dtypes=args.dtypes, ranks=args.ranks, interval_s=args.interval,
                 transport=args.transport, fixed_capacity_MiB=args.fixed_capacity_mib if not args.hosts else "-",
                 hosts=f"{args.hosts} namespace hosts, a Ray node each" if args.hosts else "one machine")
    if args.hosts:
        result = _on_hosts(args, argv)
        if result is None:
            return
    else:
        result = run(args)
    _print(result)
    plots = ("" if args.hosts else "docs/figures") if args.plots is None else args.plots
    if plots:
        from bench import plots as figures

        for path in figures.write_figures(figures.memory_figures, result, plots):
            print(f"wrote {path}")
    if args.json:
        if args.json_compact:
            result["runs"] = [{k: v for k, v in r.items() if k != "timeline"} for r in result["runs"]]
        emit_json(result)


if __name__ == "__main__":
    main()
