"""A stream's per-micro-batch release as its consumer pays for it: passes with ``release`` against passes without.

``python -m bench.release [--transports tcp,shm] [--samples 64] [--compute-ms 2] [--pairs 5] [--json]``

For each transport, ``--units`` StorageUnits in child processes hold a
rollout of ``--samples`` one-step segments of ``--tokens`` tokens (R3
``[T-1, --layers, --topk]`` uint16 and logprobs), finalized for one
reader. One rank streams all of it, ``--mb-samples`` segments a
micro-batch, with a compute stand-in of ``--compute-ms`` per micro-batch
(the host idles, as while a GPU computes; ``--host-compute python`` holds
the GIL instead). Passes come in ``--pairs`` alternating pairs, over a
rollout written anew before each (outside the clock):

- **release**: ``Reader.stream(..., release=partition)``: each
  micro-batch's references are dropped once the consumer moves past it;
  every key must be gone once the pass ends (checked, by the units'
  ``stats``);
- **keep**, the baseline: the same stream over the same bytes, its
  references kept (released after the clock stops).

``release_vs_keep`` is the ratio of the pass medians: the goal is no round
trip added per micro-batch, within 5% (the compute stand-in is short so
that a round trip would show: a real micro-batch computes for far longer).
``*_wait_ms`` is the consumer's median wait for a micro-batch after the
first, on each side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import types

from bench.common import add_json_flag, emit_json, print_header, print_table, progress_range, remote_units
from bench.trainer import HOST_COMPUTE
from bench.trainer_rank import EXPERTS, MIB, rollout, stream_pass, unit_count
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.config import GputqConfig

__all__ = ["measure", "main"]

PARTITION = "bench"


def _pass(reader: Reader, writer: Writer, clients, args, release: bool, name: str) -> tuple[float, float]:
    """One timed pass over a rollout written for it, keys ``name/i`` (each pass's own: a release id repeated
    frees nothing); returns (pass seconds, median wait after the first)."""
    shard = rollout(writer, args.samples, args.tokens, args.layers, args.topk, name)
    writer.finalize(shard, PARTITION)
    layout = types.SimpleNamespace(mb_samples=args.mb_samples, prefetch=args.prefetch, layers=args.layers, pp=1, cp=1)
    timed = stream_pass(reader, shard, layout, 0, 0, args.compute_ms / 1e3, HOST_COMPUTE[args.host_compute],
                        release=PARTITION if release else None)
    if release:
        left = unit_count(clients, "keys")
        if left:
            raise AssertionError(f"{left} keys left after a pass that released every micro-batch")
    else:
        reader.release(shard, PARTITION)
    return timed.seconds, statistics.median(wait for wait, _ in timed.steps[1:])


def measure(transport: str, args) -> dict:
    """One transport's row: the pairs' medians and ranges, and their ratio."""
    sample_bytes = (args.tokens - 1) * args.layers * args.topk * 2 + args.tokens * 2
    config = GputqConfig(transport=transport, num_units=args.units, routed_experts_dtype="uint16",
                         num_experts=EXPERTS, unit_capacity_bytes=2 * args.samples * sample_bytes // args.units
                         + 64 * MIB, host="127.0.0.1")
    times: dict[str, list] = {"keep": [], "release": []}
    waits: dict[str, list] = {"keep": [], "release": []}
    with remote_units(config) as (config, clients), Writer(clients, config) as writer, \
            Reader(clients, config) as reader:
        _pass(reader, writer, clients, args, True, "warm-up")  # warm-up: connections, buffers, threads
        for pair in progress_range(f"{transport} pairs", args.pairs):
            for side in ("keep", "release") if pair % 2 == 0 else ("release", "keep"):
                seconds, wait = _pass(reader, writer, clients, args, side == "release", f"{side}{pair}")
                times[side].append(seconds)
                waits[side].append(wait)
    row: dict = {"transport": transport}
    for side in ("keep", "release"):
        row[f"{side}_ms"] = round(statistics.median(times[side]) * 1e3, 1)
        row[f"{side}_range_ms"] = f"{min(times[side]) * 1e3:.1f}-{max(times[side]) * 1e3:.1f}"
        row[f"{side}_wait_ms"] = round(statistics.median(waits[side]) * 1e3, 3)
    row["release_vs_keep"] = round(statistics.median(times["release"]) / statistics.median(times["keep"]), 3)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.release", description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="tcp,shm", help="comma-separated: tcp, shm, rdma")
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64, help="segments of the rollout")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--mb-samples", type=int, default=2, help="segments per micro-batch")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=2.0, help="compute stand-in per micro-batch")
    parser.add_argument("--host-compute", choices=tuple(HOST_COMPUTE), default="idle",
                        help="what the host does meanwhile: idles (a GPU computing) or runs Python (holds the GIL)")
    parser.add_argument("--pairs", type=int, default=5, help="alternating pairs of passes")
    args = add_json_flag(parser).parse_args(argv)
    transports = args.transports.split(",")
    if not set(transports) <= {"tcp", "shm", "rdma"}:
        parser.error(f"--transports must name tcp, shm or rdma, got {args.transports!r}")
    if min(args.units, args.samples, args.tokens, args.layers, args.topk, args.mb_samples, args.prefetch,
           args.pairs) < 1 or args.compute_ms < 0:
        parser.error("counts must be >= 1 and --compute-ms >= 0")
    rows = [measure(transport, args) for transport in transports]
    if args.json:
        emit_json({"bench": "release", **{k: v for k, v in vars(args).items() if k != "json"}, "rows": rows})
        return 0
    print_header("a stream's per-micro-batch release, as its consumer pays for it", samples=args.samples,
                 tokens=args.tokens, layers=args.layers, topk=args.topk, mb_samples=args.mb_samples,
                 compute_ms=args.compute_ms, host_compute=args.host_compute, pairs=args.pairs, cpus=os.cpu_count())
    print_table(rows, ["transport", "keep_ms", "keep_range_ms", "release_ms", "release_range_ms", "release_vs_keep",
                       "keep_wait_ms", "release_wait_ms"])
    print("pass medians of alternating pairs; goal: release_vs_keep <= 1.05 (no round trip added per micro-batch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
