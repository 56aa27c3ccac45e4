"""The master node's trajectory memory, with and without gputq, measured per process over time.

``python -m bench.memory [--units 2,4,8] [--dtypes int32,uint16,uint8] [--scale 1] [--json]``

The same seeded synthetic rollout runs through two paths on one embedded
Ray (one machine standing in for N nodes):

- **centralised**: segments carry their fields inline (int32 IDs). A proxy
  actor sends each session's segments to a rollout-manager actor, which
  holds the batch (a private copy, as samples arriving over HTTP would be);
  the manager splits it per data-parallel rank with ``ray.put`` and the
  trainer actors ``ray.get`` their parts.
- **gputq**: the proxy actor is the writer: it puts each step's fields into
  N StorageUnits and sends lightweight samples (layouts) to the manager,
  which splits them the same way; trainers fetch their shards from the
  units and restore them.

A sampler thread here reads ``/proc/<pid>/smaps`` of every component
process (proxy, rollout manager, controller, each StorageUnit) and the
object store's used bytes every ``--interval`` seconds. Unit 0 stands for
the master's own StorageUnit; the others for units on other nodes. The
master total is proxy + rollout manager + object store + controller +
unit 0, summed per sample, its peak taken over time.

How bytes are counted (docs/PERFORMANCE.md says the same):

- a process's PSS, except two kinds of shared mapping: the object store's
  (counted once, as the store's used bytes) and a unit's arena (counted
  whole, as resident bytes, in its unit: the arena is allocated and
  touched up front, so a unit costs its capacity from the start);
- arenas are sized to the run: each unit's capacity is the busiest unit's
  stored bytes (placement is known before writing) plus 2%, so the master's
  unit holds about 1/N of the payload, not a fixed oversize;
- ``data`` figures are above each process's own idle baseline (sampled
  before the rollout starts), so an interpreter's fixed ~60 MB does not
  swamp a payload of a few hundred MB; ``raw`` figures include it.
  ``master_peak_ratio`` compares data figures.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from bench.common import Progress, add_json_flag, emit_json, print_header, print_table

__all__ = ["MemorySampler", "ObjectStoreGauge", "process_memory", "rollout_plan", "run", "main"]

MASTER = ("proxy", "rollout_manager", "object_store", "controller", "su-0")
_MIB = 1 << 20


# -- measuring --------------------------------------------------------------
def process_memory(pid: int) -> tuple[int, int]:
    """(PSS bytes outside shared stores, resident bytes of gputq arenas) of one process.

    Reads ``/proc/<pid>/smaps``: the per-mapping form of ``smaps_rollup``,
    so the object store's mapping can be set aside (it is counted once,
    as the store's used bytes) and an arena counted whole.
    """
    pss = arena = 0
    kind = None
    with open(f"/proc/{pid}/smaps", "rb") as fh:
        for line in fh:
            if line[:4] == b"Pss:":
                if kind is None:
                    pss += int(line.split()[1]) << 10
            elif line[:4] == b"Rss:":
                if kind == "arena":
                    arena += int(line.split()[1]) << 10
            elif b"-" in line[:20] and not line[:1].isupper():  # a mapping's header line
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else b""
                name = os.path.basename(path.split(b" ")[0])
                if name.startswith(b"gputq-") and name.endswith(b".arena"):
                    kind = "arena"
                elif b"plasma" in path:
                    kind = "store"
                else:
                    kind = None
    return pss, arena


class ObjectStoreGauge:
    """Bytes in use in this Ray session's object store (Ray's internal memory-info call).

    Bound to this driver's cluster by address: other Ray sessions may run
    on the same machine.
    """

    def __init__(self):
        import ray

        try:
            import grpc  # noqa: F401 -- Ray's memory-info call needs it; a minimal Ray lacks it
        except ImportError:
            from gputq.errors import MissingDependencyError

            raise MissingDependencyError("bench.memory reads the object store's used bytes through "
                                         "Ray's grpc client: pip install 'gputq[bench]'") from None
        from ray._private.internal_api import get_state_from_address

        self._state = get_state_from_address(ray.get_runtime_context().gcs_address)

    def __call__(self) -> int:
        from ray._private.internal_api import get_memory_info_reply

        return int(get_memory_info_reply(self._state).store_stats.object_store_bytes_used)


class MemorySampler:
    """Samples component memory on a background thread until :meth:`stop`.

    ``pids`` maps component name to process id. Each sample is
    ``(t, {component: bytes})``; units report PSS plus their arena.
    """

    def __init__(self, pids: dict[str, int], interval: float, store: bool = True):
        self.pids = dict(pids)
        self.interval = interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.marks: list[tuple[float, str]] = []
        self._store = ObjectStoreGauge() if store else None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="bench-memory-sampler", daemon=True)

    def start(self) -> "MemorySampler":
        self._thread.start()
        return self

    def now(self) -> float:
        """Seconds since the sampler was made (the timeline's clock)."""
        return time.perf_counter() - self._t0

    def mark(self, label: str) -> None:
        """Note a phase boundary (drawn on the timeline)."""
        self.marks.append((self.now(), label))

    def sample(self) -> dict[str, int]:
        row = {}
        for name, pid in self.pids.items():
            try:
                pss, arena = process_memory(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
            row[name] = pss + arena
            if arena:
                row[f"{name}:arena"] = arena
        if self._store is not None:
            row["object_store"] = self._store()
        return row

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                row = self.sample()
                self.samples.append((self.now(), row))
                self._stop.wait(self.interval)
        except BaseException as exc:  # reported by stop(): a silent sampler would fake a flat line
            self._error = exc

    def stop(self) -> None:
        """Stop sampling; raises what made the sampler fail, if anything did."""
        self._stop.set()
        self._thread.join(10)
        if self._error is not None:
            raise RuntimeError(f"memory sampler failed: {self._error!r}") from self._error


def summarise(sampler: MemorySampler, components: list[str], baseline_until: float) -> dict:
    """Per-component raw and data peaks, and the master total's peak (of the per-sample sum)."""
    idle = [row for t, row in sampler.samples if t <= baseline_until] or sampler.samples[:1]
    baseline = {}
    for name in components:
        values = [row.get(name, 0) - row.get(f"{name}:arena", 0) for row in idle if name in row]
        baseline[name] = int(statistics.median(values)) if values else 0

    def data(row, name):
        # A unit's arena is its data from the start; the rest counts above the idle baseline.
        return max(0, row.get(name, 0) - row.get(f"{name}:arena", 0) - baseline[name]) + \
            row.get(f"{name}:arena", 0)

    peaks = {name: {"raw": max((row.get(name, 0) for _, row in sampler.samples), default=0),
                    "data": max((data(row, name) for _, row in sampler.samples), default=0),
                    "baseline": baseline[name]} for name in components}
    master = [name for name in MASTER if name in components]
    totals = [(sum(row.get(n, 0) for n in master), sum(data(row, n) for n in master))
              for _, row in sampler.samples]
    timeline = [(round(t, 3), {n: data(row, n) for n in components}) for t, row in sampler.samples]
    return {"components": peaks, "master_raw": max(t[0] for t in totals),
            "master_data": max(t[1] for t in totals), "timeline": timeline,
            "marks": [(round(t, 3), m) for t, m in sampler.marks]}


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

    itemsize = np.dtype(dtype).itemsize
    per_unit = dict.fromkeys(units, 0)
    r3_int32 = 0
    for s in range(rollout.sessions):
        for call in generate_calls(rollout.session_config(s)):
            experts = call.engine_output["meta_info"]["routed_experts"]
            logprobs = call.engine_output["meta_info"]["output_token_logprobs"]
            r3_int32 += experts.size * 4
            unit = rendezvous_unit(step_key(_partition(run, s), call.session_id, call.step_index), units)
            # Blocks are 256-byte aligned in the arena.
            per_unit[unit] += -(-experts.size * itemsize // 256) * 256 + -(-logprobs.nbytes // 256) * 256
    return {"r3_int32": r3_int32, "per_unit": per_unit}


def digest(fields: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(fields):
        array = np.ascontiguousarray(fields[name])
        h.update(f"{name}{array.dtype.str}{array.shape}".encode())
        h.update(array.data)
    return h.hexdigest()


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
        from gputq.data.fields import FieldRegistry
        from gputq.data.trajectory import lineage_segments
        from gputq.tools.synthetic import build_sessions

        fields = FieldRegistry.builtin(rollout.synth.layers, rollout.synth.topk, config.routed_experts_dtype)
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
def _actor(ray, cls, *args):
    return ray.remote(num_cpus=0, max_concurrency=2)(cls).remote(*args)


def _measure(ray, pids: dict, args, work) -> tuple[dict, object]:
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
    return summarise(sampler, list(pids) + ["object_store"], baseline_until), result


def run_centralised(ray, rollout: Rollout, args) -> tuple[dict, dict]:
    proxy, manager = _actor(ray, Proxy), _actor(ray, Manager)
    trainers = [_actor(ray, Trainer) for _ in range(args.ranks)]
    pids = dict(zip(["proxy", "rollout_manager"], ray.get([proxy.pid.remote(), manager.pid.remote()])))

    def work(sampler):
        ray.get(proxy.centralised.remote(manager, rollout))
        sampler.mark("batch held")
        parts = ray.get(manager.split.remote(args.ranks))
        sampler.mark("split")
        digests = {}
        for d in ray.get([t.train.remote(parts, r) for r, t in enumerate(trainers)]):
            digests.update(d)
        sampler.mark("trained")
        del parts  # this driver's references would keep the parts in the store
        ray.get(manager.clear.remote())
        return digests

    try:
        return _measure(ray, pids, args, work)
    finally:
        for actor in [proxy, manager, *trainers]:
            ray.kill(actor)


def run_gputq(ray, rollout: Rollout, units: int, dtype: str, args, run: str) -> tuple[dict, dict]:
    from gputq.cluster.deploy import Deployment
    from gputq.config import GputqConfig

    names = [f"su-{i}" for i in range(units)]
    plan = rollout_plan(rollout, names, dtype, run)
    capacity = int(max(plan["per_unit"].values()) * 1.02) + _MIB
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, routed_experts_dtype=dtype,
                         transport=args.transport, num_units=units, unit_capacity_bytes=capacity)
    with Deployment.start(config) as deployment:
        config = deployment.config
        membership = deployment.membership()
        proxy, manager = _actor(ray, Proxy), _actor(ray, Manager)
        trainers = [_actor(ray, Trainer, membership, config) for _ in range(args.ranks)]
        handles = {"proxy": proxy, "rollout_manager": manager, "controller": deployment.controller,
                   **deployment.units}
        getpid = lambda self: os.getpid()  # noqa: E731 -- runs inside each actor
        pids = dict(zip(handles, ray.get([h.__ray_call__.remote(getpid) for h in handles.values()])))

        def work(sampler):
            written = ray.get(proxy.gputq.remote(manager, rollout, membership, config, run))
            sampler.mark("batch held")
            parts = ray.get(manager.split.remote(args.ranks))
            sampler.mark("split")
            digests = {}
            for d in ray.get([t.train.remote(parts, r) for r, t in enumerate(trainers)]):
                digests.update(d)
            sampler.mark("trained")
            del parts
            ray.get(manager.clear.remote())
            for s in range(rollout.sessions):
                deployment.release_partition(_partition(run, s))
            return {"digests": digests, "written": written}

        try:
            summary, result = _measure(ray, pids, args, work)
        finally:
            ray.get([t.close.remote() for t in trainers])
            for actor in [proxy, manager, *trainers]:
                ray.kill(actor)
    summary["capacity_per_unit"] = capacity
    summary["stored_per_unit"] = plan["per_unit"]
    return summary, result


# -- the sweep ----------------------------------------------------------------
def _row(path: str, units, dtype: str, summary: dict, central: dict | None) -> dict:
    comp = summary["components"]
    row = {"path": path, "units": units or "-", "dtype": dtype,
           **{name: round(comp[name]["data"] / _MIB, 1) for name in MASTER if name in comp},
           "master_MiB": round(summary["master_data"] / _MIB, 1),
           "master_raw_MiB": round(summary["master_raw"] / _MIB, 1)}
    if central is not None:
        row["ratio"] = round(summary["master_data"] / central["master_data"], 3)
        row["raw_ratio"] = round(summary["master_raw"] / central["master_raw"], 3)
    return row


def calibration(r3_int32: int, central: dict, runs: list[dict]) -> dict:
    """Bytes per R3 byte for ``gputq capacity``: centralised, gputq residual, local unit per stored byte."""
    gputq = [r for r in runs if r["path"] == "gputq"]
    residual = [(r["master_data"] - r["components"]["su-0"]["data"]) / r3_int32 for r in gputq]
    local = [r["components"]["su-0"]["data"] / (r["stored_bytes"] / r["units"]) for r in gputq]
    return {"centralised": central["master_data"] / r3_int32, "residual": statistics.median(residual),
            "local_unit": statistics.median(local), "r3_int32_bytes": r3_int32}


def run(args) -> dict:
    from gputq.cluster.names import import_ray
    from gputq.tools.synthetic import SyntheticConfig

    ray = import_ray()
    tokens = args.tokens
    synth = SyntheticConfig(sessions=1, steps_per_session=args.steps, layers=args.layers, topk=args.topk,
                            num_experts=args.experts, prompt_tokens=tokens // 2, tokens_per_step=tokens,
                            tool_tokens=tokens // 8, branch_prob=0.0, rewrite_prob=0.2, seed=args.seed)
    rollout = Rollout(sessions=max(1, int(round(args.sessions * args.scale))), synth=synth)
    units_list = [int(u) for u in args.units.split(",")]
    dtypes = args.dtypes.split(",")
    r3_int32 = rollout_plan(rollout, ["su-0"], "int32")["r3_int32"]
    store = int(max(4 * r3_int32, 256 * _MIB))
    # address="local": a new cluster of our own, never one another job left on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=store)
    runs = []
    try:
        with Progress("bench.memory", 1 + len(units_list) * len(dtypes)) as progress:
            progress.note("centralised")
            central, central_digests = run_centralised(ray, rollout, args)
            central.update(path="centralised", units=0, dtype="int32", stored_bytes=0)
            runs.append(central)
            progress.step("centralised done")
            for n in units_list:
                for dtype in dtypes:
                    progress.note(f"gputq {n} units {dtype}")
                    summary, result = run_gputq(ray, rollout, n, dtype, args, run=f"n{n}{dtype}")
                    summary.update(path="gputq", units=n, dtype=dtype, stored_bytes=result["written"],
                                   verified=result["digests"] == central_digests)
                    runs.append(summary)
                    progress.step(f"gputq {n} units {dtype}: master {summary['master_data'] / _MIB:.0f} MiB")
    finally:
        ray.shutdown()
    rows = [_row("centralised", None, "int32", central, None)] + \
        [_row("gputq", r["units"], r["dtype"], r, central) for r in runs[1:]]
    by = {(r["units"], r["dtype"]): r for r in runs[1:]}
    headline = by.get((2, "uint16")) or runs[-1]
    return {
        "bench": "memory",
        "rows": rows,
        "r3_int32_bytes": r3_int32,
        "master_peak_ratio": headline["master_data"] / central["master_data"],
        "master_peak_ratio_raw": headline["master_raw"] / central["master_raw"],
        "headline": {"units": headline["units"], "dtype": headline["dtype"]},
        "verified": all(r.get("verified", True) for r in runs),
        "calibration": calibration(r3_int32, central, runs),
        "runs": runs,
        "config": {"sessions": rollout.sessions, "steps": args.steps, "tokens": tokens, "layers": args.layers,
                   "topk": args.topk, "ranks": args.ranks, "interval_s": args.interval,
                   "transport": args.transport},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--units", default="2,4,8", help="StorageUnit counts N to sweep")
    parser.add_argument("--dtypes", default="int32,uint16,uint8", help="stored expert-ID dtypes to sweep")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of sessions")
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=640, help="mean output tokens per model call")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="tcp")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    parser.add_argument("--idle", type=float, default=1.0, help="idle seconds sampled for each baseline")
    parser.add_argument("--plots", default="docs/figures", help="write PNGs here ('' to skip)")
    parser.add_argument("--json-compact", action="store_true", help="leave timelines out of the JSON line")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    print_header("master-node memory: centralised vs gputq", sessions=round(args.sessions * args.scale),
                 steps=args.steps, tokens=args.tokens, row=f"L={args.layers} K={args.topk}",
                 units=args.units, dtypes=args.dtypes, ranks=args.ranks, interval_s=args.interval,
                 transport=args.transport)
    result = run(args)
    columns = ["path", "units", "dtype", *MASTER, "master_MiB", "master_raw_MiB", "ratio", "raw_ratio"]
    print_table(result["rows"], columns)
    cal = result["calibration"]
    print(f"R3 carried (int32): {result['r3_int32_bytes'] / _MIB:.1f} MiB; master peak ratio "
          f"(2 units, uint16): {result['master_peak_ratio']:.3f} (raw {result['master_peak_ratio_raw']:.3f}); "
          f"verified {result['verified']}")
    print(f"calibration per R3 byte: centralised {cal['centralised']:.3f}, gputq residual "
          f"{cal['residual']:.4f}, local unit per stored byte {cal['local_unit']:.3f}")
    if args.plots:
        from bench import plots

        for path in plots.write_figures(plots.memory_figures, result, args.plots):
            print(f"wrote {path}")
    if args.json:
        if args.json_compact:
            result["runs"] = [{k: v for k, v in r.items() if k != "timeline"} for r in result["runs"]]
        emit_json(result)


if __name__ == "__main__":
    main()
