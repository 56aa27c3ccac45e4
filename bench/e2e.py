"""The rollout-to-trainer path with gputq against the centralised path, in one run.

``python -m bench.e2e [--sessions 16] [--tokens 2048] [--json]``

Both paths start from the same synthetic sessions on an embedded local Ray
and end with every trainer rank holding its shard's restored fields:

- **gputq**: the writer stores each step's fields in StorageUnits; slime
  samples carry layouts through a rollout-manager actor; each rank fetches its
  shard from the units and restores it.
- **centralised** (no offload): each sample carries its restored fields
  (`rollout_log_probs`, `rollout_routed_experts` int32) through the same
  rollout-manager actor, i.e. through the Ray object store, as slime does
  without gputq.

Both timers cover the same work, from the seeded engine outputs to every
rank holding its hashed fields: generating the synthetic rollout (same
seed, same cost on both sides), then for gputq writing every step into the
units, flushing, composing segments and finalizing their references, and
for the centralised path composing segments with their fields inline;
then the rollout manager, the per-rank split and the trainers. Releasing
the partition afterwards is not timed (it overlaps the next rollout).
Reported per rollout: bytes that crossed Ray and those seconds; the first
rollout warms connections, pools and the object store and is not counted
in the summary.
"""

from __future__ import annotations

import argparse
import pickle
import time

from bench.common import add_json_flag, emit_json, print_header, print_table, progress_range
from gputq.client.writer import Writer
from gputq.cluster.deploy import Deployment
from gputq.cluster.names import import_ray
from gputq.config import GputqConfig
from gputq.data.fields import FieldRegistry
from gputq.data.trajectory import inline_fields, lineage_segments
from gputq.integrations.slime import to_slime_sample
from gputq.tools.demo import RolloutManager, TrainerRank, digest_fields
from gputq.tools.synthetic import SyntheticConfig, build_sessions


class InlineTrainer:
    """A rank of the centralised path: its fields arrive inside the samples."""

    def __init__(self, rank: int):
        self.rank = rank

    def train_step(self, manager, world: int) -> dict:
        import ray

        samples = ray.get(manager.shard.remote(self.rank, world))
        return {"digests": {s["segment_id"]: digest_fields(s["fields"]) for s in samples}}


def _gputq_step(ray, deployment, synth, fields, config, trainers, partition):
    """One rollout through gputq; returns (seconds, Ray bytes, digests)."""
    manager = ray.remote(num_cpus=0)(RolloutManager).remote()
    started = time.perf_counter()
    with deployment.clients() as clients, Writer(clients, config) as writer:
        sessions = build_sessions(synth, fields=fields, writer=writer, partition=partition, inline=False)
        writer.flush()
        segments = [seg for s in sessions for seg in lineage_segments(s)]
        writer.finalize([seg.layouts for seg in segments], partition)
    samples = [{**to_slime_sample(seg), "index": i} for i, seg in enumerate(segments)]
    ray.get(manager.submit.remote(samples))
    reports = ray.get([t.train_step.remote(manager, len(trainers), partition) for t in trainers])
    seconds = time.perf_counter() - started
    deployment.release_partition(partition)
    return seconds, len(pickle.dumps(samples)), \
        {segments[i].segment_id: d for r in reports for i, d in r["digests"].items()}


def _central_step(ray, synth, fields, trainers):
    """One rollout through the Ray object store; returns (seconds, Ray bytes, digests, segments)."""
    manager = ray.remote(num_cpus=0)(RolloutManager).remote()
    started = time.perf_counter()
    sessions = build_sessions(synth, fields=fields, inline=True)
    segments = [seg for s in sessions for seg in lineage_segments(s)]
    fat = [{"segment_id": seg.segment_id, "tokens": seg.tokens, "fields": inline_fields(seg)} for seg in segments]
    ray.get(manager.submit.remote(fat))
    reports = ray.get([t.train_step.remote(manager, len(trainers)) for t in trainers])
    seconds = time.perf_counter() - started
    return seconds, len(pickle.dumps(fat)), {sid: d for r in reports for sid, d in r["digests"].items()}, \
        segments


def run(args) -> dict:
    ray = import_ray()
    synth = SyntheticConfig(sessions=args.sessions, steps_per_session=args.steps, layers=args.layers,
                            topk=args.topk, num_experts=args.experts, prompt_tokens=args.tokens // 2,
                            tokens_per_step=args.tokens, tool_tokens=args.tokens // 8, branch_prob=0.25,
                            rewrite_prob=0.2, seed=1)
    config = GputqConfig(enabled=True, use_rollout_routing_replay=True, routed_experts_dtype=args.dtype,
                         transport=args.transport, num_units=args.units,
                         unit_capacity_bytes=args.unit_mib << 20)
    # address="local": our own cluster, never one another job left on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        return _rollouts(ray, args, synth, config)
    finally:
        ray.shutdown()


def _rollouts(ray, args, synth, config) -> dict:
    """The warm-up rollout and the timed ones, each through both paths."""
    rows, byte_ratios = [], []
    with Deployment.start(config) as deployment:
        config = deployment.config
        fields = FieldRegistry.builtin(args.layers, args.topk, args.dtype)
        trainers = [ray.remote(num_cpus=0)(TrainerRank).remote(r, deployment.membership(), config)
                    for r in range(args.ranks)]
        inline_trainers = [ray.remote(num_cpus=0)(InlineTrainer).remote(r) for r in range(args.ranks)]
        inline_registry = FieldRegistry.builtin(args.layers, args.topk)
        # Rollout 0 warms connections, pools and the object store; later rollouts are timed.
        for step in progress_range("bench.e2e rollouts", args.rollouts + 1):
            g_s, g_bytes, g_got = _gputq_step(ray, deployment, synth, fields, config, trainers, f"rollout-{step}")
            c_s, c_bytes, c_got, segments = _central_step(ray, synth, inline_registry, inline_trainers)
            expected = {seg.segment_id: digest_fields(inline_fields(seg)) for seg in segments}
            byte_ratios.append(g_bytes / c_bytes)
            rows.append({"rollout": step, "warm": step > 0, "gputq_s": round(g_s, 3),
                         "centralised_s": round(c_s, 3), "speedup": round(c_s / g_s, 2),
                         "gputq_ray_MB": round(g_bytes / 1e6, 2), "centralised_ray_MB": round(c_bytes / 1e6, 1),
                         "verified": g_got == expected and c_got == expected})
        ray.get([t.close.remote() for t in trainers])
    warm = [r for r in rows if r["warm"]]
    return {"rows": rows, "segments": len(segments), "verified": all(r["verified"] for r in rows),
            "speedup_vs_centralised": min(r["speedup"] for r in warm),
            "ray_bytes_ratio": max(byte_ratios)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="output tokens per model call")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--dtype", choices=("uint8", "uint16", "int32"), default="uint16")
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--unit-mib", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--transport", choices=("auto", "rdma", "tcp"), default="auto")
    parser.add_argument("--rollouts", type=int, default=2, help="timed rollouts after one warm-up rollout")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    print_header("rollout -> trainer: gputq vs centralised (Ray object store)", sessions=args.sessions,
                 steps=args.steps, tokens=args.tokens, row=f"L={args.layers} K={args.topk} {args.dtype}",
                 units=args.units, ranks=args.ranks, transport=args.transport, device="cpu")
    result = run(args)
    print_table(result["rows"], list(result["rows"][0]))
    print(f"{result['segments']} segments per rollout; bytes through Ray, gputq / centralised: "
          f"{result['ray_bytes_ratio']:.4f}; warm speedup vs centralised (min): "
          f"{result['speedup_vs_centralised']:.2f}x; verified {result['verified']}")
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
