"""``gputq demo``: the whole offload path on an embedded local Ray.

1. synthetic sessions (branches, context rewrites) whose model calls come
   back in SGLang's wire format (base64 routed experts, logprob triples);
2. each response goes through the SGLang ingest path: decoded, trimmed,
   range-checked and stored with the step in one commit region;
3. segments are composed from references only, and become slime samples;
4. the samples go through a rollout-manager actor;
5. trainer actors (one per data-parallel rank) hydrate their split in place,
   which also runs slime's shape checks, and release it;
6. every restored field is compared bit for bit with the inline path.

Payload bytes never cross Ray: samples carry layouts, trainers return
digests of what they restored.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import time
from dataclasses import dataclass

import numpy as np

from gputq.client.clients import UnitClients
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.cluster.deploy import Deployment
from gputq.cluster.names import import_ray
from gputq.config import GputqConfig
from gputq.data.fields import routed_experts_spec, row_nbytes
from gputq.data.trajectory import inline_fields, lineage_segments, timeline_segments
from gputq.integrations.sglang import RolloutIngest
from gputq.integrations.slime import LOG_PROBS, ROUTED_EXPERTS_KEY, hydrate, to_slime_sample
from gputq.tools.scenarios import blocking, overlapping_rollouts
from gputq.tools.synthetic import SyntheticConfig, ingest_synthetic

__all__ = ["DemoOptions", "run_demo", "demo_bytes", "format_summary", "TrainerRank", "RolloutManager", "digest_fields"]


@dataclass(frozen=True)
class DemoOptions:
    """What ``gputq demo`` runs; see ``gputq demo --help``."""

    sessions: int = 8
    steps: int = 4
    units: int = 2
    ranks: int = 2
    dtype: str = "uint16"
    layers: int = 48
    topk: int = 8
    experts: int = 128
    tokens: int = 1024
    transport: str = "auto"
    device: str = "cpu"
    view: str = "lineage"
    seed: int = 0
    overlap: bool = False


def digest_fields(fields: dict) -> dict[str, str]:
    """SHA-256 of each restored field's dtype, shape and bytes."""
    out = {}
    for name, value in sorted(fields.items()):
        array = value.cpu().numpy() if hasattr(value, "cpu") else np.asarray(value)
        h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
        h.update(np.ascontiguousarray(array).data)
        out[name] = h.hexdigest()
    return out


class RolloutManager:
    """Holds lightweight samples and deals them out to data-parallel ranks."""

    def __init__(self):
        self._samples: list[dict] = []

    def submit(self, samples: list[dict]) -> int:
        self._samples.extend(samples)
        return len(self._samples)

    def shard(self, rank: int, world: int) -> list[dict]:
        return self._samples[rank::world]


class TrainerRank:
    """One data-parallel rank: hydrates its slime samples and reports digests and stats."""

    def __init__(self, rank: int, membership: dict, config: GputqConfig, device: str = "cpu"):
        self.rank = rank
        self._clients = UnitClients(membership, config)
        self._reader = Reader(self._clients, config, device=device)
        for unit in self._clients.units:  # connect now, so fetch timings are transfers only
            self._clients.channel(unit)

    def train_step(self, manager, world: int, partition: str) -> dict:
        import ray


        samples = ray.get(manager.shard.remote(self.rank, world))
        # In place, slime's checks included; the consumed shard is released.
        hydrate(samples, self._reader, partition)
        stats = self._reader.last_stats
        # What the rank waited for its tensors: the transfer and the restore. Read in place (shm),
        # the transfer part is a lease round trip and the copying happens in the restore.
        waited = stats.fetch_seconds + stats.restore_seconds
        digests = {s["index"]: digest_fields({k: s[k] for k in (LOG_PROBS, ROUTED_EXPERTS_KEY) if k in s})
                   for s in samples}
        return {"rank": self.rank, "digests": digests, "unique_keys": stats.unique_keys,
                "referenced_keys": stats.referenced_keys, "bytes_fetched": stats.bytes_fetched,
                "fetch_seconds": stats.fetch_seconds, "restore_seconds": stats.restore_seconds,
                "fetch_restore_seconds": waited,
                "transports": sorted({self._clients.transport_of(u)[0] for u in self._clients.units})}

    def close(self) -> None:
        self._reader.close()
        self._clients.close()


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stdout, flush=True)


def demo_bytes(sessions: int, steps: int, tokens: int, row_bytes: int) -> int:
    """About the expert-ID bytes the demo stores: per session ~(prompt + steps*(out+tool)) rows of
    ``row_bytes`` (L*K IDs stored), with the prompt half a call's output and a tool reply an eighth (as
    :func:`run_demo` sets them)."""
    per_session = tokens // 2 + 2 * steps * (tokens + max(1, tokens // 8))
    return sessions * per_session * row_bytes


@dataclass
class _Rollout:
    """What the demo's rollout left: the sessions, their segments and what writing them took."""

    sessions: list
    segments: list
    aborted: int
    write_seconds: float
    bytes_offloaded: int


def _demo_config(options: DemoOptions, config: GputqConfig | None) -> GputqConfig:
    """``config`` (default: :meth:`GputqConfig.load`) with the options' settings and units sized for them."""
    spec = routed_experts_spec(options.layers, options.topk, options.dtype, options.experts)
    estimate = demo_bytes(options.sessions, options.steps, options.tokens, row_nbytes(spec))
    capacity = max(64 << 20, int(1.5 * estimate / options.units))
    return (config if config is not None else GputqConfig.load()).replace(
        enabled=True, use_rollout_routing_replay=True, routed_experts_dtype=options.dtype, num_experts=options.experts,
        transport=options.transport, num_units=options.units, unit_capacity_bytes=capacity)


def _roll_out(options: DemoOptions, clients, config: GputqConfig, partition: str) -> _Rollout:
    """SGLang responses of synthetic sessions through the ingest path into the units; segments composed
    from their references (each step then lives as long as a segment that uses it)."""
    synth = SyntheticConfig(sessions=options.sessions, steps_per_session=options.steps,
                            layers=options.layers, topk=options.topk, num_experts=options.experts,
                            prompt_tokens=options.tokens // 2, tokens_per_step=options.tokens,
                            tool_tokens=max(1, options.tokens // 8), branch_prob=0.25, rewrite_prob=0.2,
                            seed=options.seed)
    with Writer(clients, config) as writer:
        started = time.perf_counter()
        ingest = RolloutIngest(config, num_layers=options.layers, topk=options.topk, partition=partition,
                               writer=writer, keep_inline=True)
        sessions = ingest_synthetic(synth, ingest)
        writer.flush()
        write_seconds = time.perf_counter() - started
        make = lineage_segments if options.view == "lineage" else timeline_segments
        segments = [seg for session in sessions for seg in make(session)]
        writer.finalize([seg.layouts for seg in segments], partition)
        return _Rollout(sessions, segments, ingest.aborted, write_seconds, writer.bytes_written)


def _train(ray, deployment, config: GputqConfig, options: DemoOptions, samples: list, partition: str,
           progress: bool) -> list:
    """The samples through the rollout manager to the trainer ranks, which hydrate theirs: their reports."""
    manager = ray.remote(num_cpus=0)(RolloutManager).remote()
    ray.get(manager.submit.remote(samples))
    membership = deployment.membership()
    trainer_cls = ray.remote(num_cpus=0)(TrainerRank)
    trainers = [trainer_cls.remote(rank, membership, config, options.device) for rank in range(options.ranks)]
    _say(progress, f"[5/6] {options.ranks} trainer ranks hydrating their samples (slime's checks)")
    reports = ray.get([t.train_step.remote(manager, options.ranks, partition) for t in trainers])
    ray.get([t.close.remote() for t in trainers])
    return reports


def run_demo(options: DemoOptions, *, config: GputqConfig | None = None, progress: bool = True) -> dict:
    """Run the demo; returns the summary (``verified`` and the figures).

    ``config`` (default: ``GputqConfig.load()``, the file and ``GPUTQ_*``
    variables) supplies every setting the options do not fix.
    """
    ray = import_ray()
    t0 = time.perf_counter()
    config = _demo_config(options, config)
    partition = "rollout-0"
    _say(progress, f"[1/6] starting Ray with {options.units} StorageUnits of {config.unit_capacity_bytes >> 20} MiB")
    with Deployment.start(config, num_cpus=2) as deployment:
        config = deployment.config
        ray.get(deployment.controller.open_partition.remote(partition))
        clients = deployment.clients()
        used = {clients.transport_of(unit) for unit in clients.units}
        _say(progress, "      transport: " + "; ".join(f"{name} ({reason})" for name, reason in sorted(used)))
        _say(progress, f"[2/6] {options.sessions} sessions: SGLang responses (base64 meta_info) "
                       f"through the ingest path into StorageUnits")
        rollout = _roll_out(options, clients, config, partition)
        segments = rollout.segments
        _say(progress, f"[3/6] composed {len(segments)} {options.view} segments from references")
        samples = [{**to_slime_sample(seg), "index": i} for i, seg in enumerate(segments)]
        sample_bytes = len(pickle.dumps(samples))
        _say(progress, f"[4/6] {len(samples)} slime samples ({sample_bytes / 1e6:.2f} MB) sent through the "
                       f"rollout manager; {rollout.bytes_offloaded / 1e6:.1f} MB stayed in StorageUnits")
        reports = _train(ray, deployment, config, options, samples, partition, progress)
        _say(progress, "[6/6] comparing with the inline (non-offloaded) path")
        expected = {i: digest_fields(inline_fields(seg)) for i, seg in enumerate(segments)}
        released = ray.get(deployment.controller.release_partition.remote(partition))
        overlap = None
        if options.overlap:
            _say(progress, "[+] two overlapping rollouts: sessions carried over, groups filtered out")
            overlap = overlapping_rollouts(blocking(deployment.controller), clients, config,
                                           sessions=options.sessions, steps=options.steps, layers=options.layers,
                                           topk=options.topk, experts=options.experts,
                                           tokens=max(2, options.tokens // 2), seed=options.seed)
        invariants = ray.get(deployment.controller.check_invariants.remote())
        stats = deployment.stats()
        clients.close()
    result = _summary(options, rollout, reports, expected, sample_bytes, released, invariants, stats, overlap)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    if progress:
        print(format_summary(result))
    return result


def _summary(options: DemoOptions, rollout: _Rollout, reports: list, expected: dict, sample_bytes: int,
             released: dict, invariants: dict, stats: dict, overlap: dict | None) -> dict:
    """The demo's result: whether every rank's fields equal the inline path's, and the figures."""
    got = {i: d for report in reports for i, d in report["digests"].items()}
    mismatched = sorted(rollout.segments[i].segment_id for i in expected if got.get(i) != expected[i])
    # Ranks fetch at once: the bytes of all over the slowest rank's fetch+restore.
    waited = max(r["fetch_restore_seconds"] for r in reports)
    bytes_fetched = sum(r["bytes_fetched"] for r in reports)
    return {
        "verified": (not mismatched and len(got) == len(expected) and invariants["ok"]
                     and (overlap is None or overlap["verified"])),
        "mismatched": mismatched[:10],
        "segments": len(rollout.segments),
        "steps": sum(len(s.steps) for s in rollout.sessions),
        "aborted_requests": rollout.aborted,
        "unique_keys_fetched_per_rank": [r["unique_keys"] for r in reports],
        "referenced_keys_per_rank": [r["referenced_keys"] for r in reports],
        "bytes_offloaded": rollout.bytes_offloaded,
        "bytes_fetched": bytes_fetched,
        "sample_bytes_through_ray": sample_bytes,
        "rollout_seconds": round(rollout.write_seconds, 3),
        "fetch_restore_seconds": round(waited, 6),
        "fetch_restore_gbps": bytes_fetched / waited / 1e9 if waited else 0.0,
        "transport": sorted({t for r in reports for t in r["transports"]}),
        "dtype": options.dtype,
        "keys_left_after_release": int(stats["totals"]["keys"]),
        "keys_freed_at_rollout_release": int(released["freed"]),
        "invariants_ok": bool(invariants["ok"]),
        "invariant_violations": invariants["violations"][:10],
        "overlap": overlap,
    }


def format_summary(r: dict) -> str:
    """The lines ``gputq demo`` prints after its steps, from :func:`run_demo`'s result."""
    lines = [
        f"\n  verified bit-exact: {r['verified']}  ({r['segments']} segments from {r['steps']} steps)",
        f"  offloaded {r['bytes_offloaded'] / 1e6:.1f} MB; through Ray {r['sample_bytes_through_ray'] / 1e6:.2f} MB",
        f"  unique keys fetched per rank {r['unique_keys_fetched_per_rank']} "
        f"(referenced {r['referenced_keys_per_rank']})",
        f"  rollout (generate + write) {r['rollout_seconds']} s; cold fetch+restore "
        f"{r['fetch_restore_gbps']:.2f} GB/s over {r['transport']} ({r['bytes_fetched'] / 1e6:.1f} MB in "
        f"{r['fetch_restore_seconds'] * 1e3:.1f} ms, the slowest rank's wait; python -m bench.fetch "
        f"measures warm fetches)",
        f"  keys left after the ranks released their segments and the rollout was released: "
        f"{r['keys_left_after_release']} ({r['keys_freed_at_rollout_release']} freed by the latter); "
        f"{r['seconds']} s in all",
        f"  invariants at the end (every stored key held by a live rollout, every reference stored): "
        f"{'ok' if r['invariants_ok'] else r['invariant_violations']}",
    ]
    if r["overlap"] is not None:
        o = r["overlap"]
        lines.append(f"  overlapping rollouts: {o['segments_consumed']} segments consumed, {o['segments_dropped']} "
                     f"dropped, {o['sessions_carried']} sessions carried; arena left {o['keys_left']} keys, "
                     f"{o['bytes_left']} bytes; verified {o['verified']}")
    return "\n".join(lines)
