"""The trainer side at scale: each rank streams its slice, micro-batch by micro-batch, overlapped with compute.

``python -m bench.trainer [--dp 2 --pp 4 --cp 2] [--transport tcp|shm|rdma|auto] [--scales 1,2,4] [--json]``

A synthetic rollout of ``--samples`` segments per data-parallel rank (at
scale 1) of ``--tokens`` tokens each, R3 ``[T-1, L, K]`` stored as
``--dtype`` plus response logprobs, is written to StorageUnits in child
processes (tcp over loopback, or shm/rdma). Every rank of a DP x PP x CP
layout streams its DP shard with ``Reader.stream``: its stage's
``L / PP`` layers, its two zigzag CP chunks, micro-batches of
``--mb-samples`` segments, ``--prefetch`` ahead; only the last stage reads
logprobs (it computes the loss). Three figures, each against its goal:

- **bytes**: what each rank moved, by the units' own ``bytes_read``
  counters, against today's whole-shard ``Reader.fetch`` of the same DP
  shard (every rank of the group fetched all of it). The group's ranks
  together move the shard once: ``bytes_ratio_vs_whole_shard`` is their
  mean share, goal ``1 / (PP x CP)`` within 1%; each rank's bytes must
  equal the slice its spans name, exactly.
- **memory**: peak anonymous RSS (sampled every millisecond; a same-host
  reader's mapped arena pages are the unit's) above its start of a fresh
  reader process (rank dp0/pp0/cp0) at shard scales 1x, 2x and 4x,
  streamed and whole-shard;
  ``peak_growth_4x`` is the streamed peak at 4x over 1x, goal <= 1.10.
  The shard at 1x is at least 4x the stream's buffers (checked).
- **overlap**: the streamed loop over one training step's shard with a
  compute stand-in per micro-batch (the host idles, as it does while the
  GPU computes) of twice the micro-batch's fetch+restore time, against that
  compute alone: ``overlap_ratio``, goal <= 1.05, the median of
  ``--overlap-steps`` steps (default 5; ``overlap.step_ratios`` holds each
  step's, ``overlap`` the median step's waits). A step holds
  ``--step-samples`` segments per DP rank (default 128, the reference
  deployment's: 4,096 segments over DP 32), cycling through the largest
  stored shard (each micro-batch reads its own bytes). The first
  micro-batch's fetch has nothing to hide behind (a trainer that opens the
  stream before its step hides it too); the fewer micro-batches a step
  has, the more it weighs: ``overlap_ratio_after_first`` leaves it out,
  and ``--step-samples 0`` measures over the largest stored shard alone.
  Of the first wait (``overlap.first_wait_ms``), ``overlap.open_ms`` is
  ``Reader.stream`` returning: every micro-batch of the step checked and
  sized before the first read.
  ``--overlap-compute-ms`` fixes the compute instead (the goal's is twice
  the fetch+restore): two libraries compared at one compute, where a
  slower stream would otherwise be given a longer compute to hide behind.
  ``--host-compute python`` runs Python for the compute instead of idling:
  a training loop that holds the GIL while it dispatches kernels. The
  stream's threads then wait for the interpreter to switch to them each
  time they come back from a system call or a widen (up to its switch
  interval, 5 ms by default; ``--switch-interval-ms`` sets it for the
  overlap's steps, as ``sys.setswitchinterval`` would in a trainer).

The streamed loop without compute also gives fetch+restore throughput of
the rank's slice, paired with the strongest honest baseline of its
transport, timed just before each pass over the same bytes: a plain socket
from a child process (tcp, rdma), a memcpy on as many threads as the stream
uses (shm: its fetch and restore threads). Goals: >= 0.9x the socket over
tcp, >= 0.8x the memcpy over shm, for shards (rank slices) >= 16 MiB. Each
side also reports the cores kept busy over a quarter second of its passes
by this process and the ones doing its work (the units for the stream, the
server for the socket) (``stream_cores``, ``baseline_cores``), and the
stream's CPU per byte against the baseline's: what a miss is spent on.
Per MiB moved, each side's CPU microseconds are split between this
process, which receives and restores (``*_receiver_us_per_MiB``, for the
ceiling and the reads alone too), and the processes that send
(``stream_units_us_per_MiB``, ``baseline_sender_us_per_MiB``): a process
kept busy all the time bounds its side's throughput by its CPU per byte.
The stream's receiver is split by thread as well (``stream_consumer``,
``stream_fetch_thread``, ``stream_restore_thread``, each ``_us_per_MiB``):
its stages run one per thread, so a thread busy the whole pass is the
stream's pace however many cores the host has.
``unit_requests_per_micro_batch`` counts what the units served for one
pass (their ``reads``: a read request over tcp, a lease over shm and rdma)
per micro-batch. Where the kernel says (Linux), ``*_waiting_cores`` are the cores' worth
of each side's threads that were runnable but waiting for a core over
the passes: with more runnable threads than cores at moments and idle
cores at others, a side is slower than its CPU per byte alone implies.

Beside each baseline the same pass times a **ceiling**: the same bytes
restored with no gputq in it, from the plainest parts. Over tcp,
the plain socket's reads of each micro-batch's bytes, widened to int32 as
they land, 64 KiB at a time, on the receiving thread
(:class:`~bench.common.SocketWidened`); over shm, the same bytes widened
to int32 on the memcpy's threads, and (``one_thread_widen_vs_ceiling``)
on one thread, as the stream's restore widens: where that reaches the
ceiling, the widen is bound by memory, not by the stream's one restore
thread.
``ceiling_vs_baseline`` is its ratio to the baseline (where it is below a
goal, the goal asks more of this machine than a bare socket or memory plus
numpy's widen gives: the widened output is twice the bytes),
``stream_vs_ceiling`` the stream's to it (what gputq's own work costs), and
``second_half_vs_ceiling`` the pace of a pass's later half of micro-batches
against the ceiling's over as many bytes (the consumer's waits for them):
what the stream costs once its opening and first fetches are behind it.
Over tcp the same pass also times the stream's **reads alone**: the
rank's micro-batches planned before the pass, their span reads sent one
micro-batch ahead on one pipeline per unit and widened as they land into
reused outputs, as the stream does, with nothing else of the stream (no
planning, no pad rows or checks, no hand-off to the consumer).
``reads_vs_baseline`` is what the units and the transport reach;
``stream_vs_reads`` what the stream's own work per micro-batch costs on
top of them. Over shm (IDs not packed) it times the stream's **restores
alone**: every micro-batch planned and its regions leased in the mapped
arenas before the clock starts, then only the stream's widen and shaping
of each, one after another on one thread, into reused outputs (the leases
end after the clock stops). ``restores_vs_ceiling`` is what one restore
thread reaches over the slice's own layout (a stage's layers, a CP rank's
chunks: dozens of runs a micro-batch, not the ceiling's one contiguous
widen); ``stream_vs_restores`` what the stream's planning, leases and
hand-offs cost on top of them.

The process stands for a trainer: torch loaded, and the objects alive
after setup frozen (``gc.freeze``), as trainers that manage their garbage
collector do (Megatron's ``--manual-gc``): with torch's objects in it, a
full collection takes ~0.1 s, and one triggered by any allocation of the
loop would land in a single micro-batch's wait.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing
import statistics
import sys
import threading
import time

from bench.common import (
    add_json_flag,
    emit_json,
    print_header,
    print_table,
    progress_range,
    remote_units,
    trainer_runtime,
)
from bench.plots import trainer_memory_figure, write_figures
from bench.trainer_rank import EXPERTS, MIB, bytes_read, micro_batches, rank_slice, rollout, run_python, stream_pass
from bench.trainer_throughput import STAGE_THREADS, throughput, throughput_summary
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.config import GputqConfig
from gputq.data.fields import routed_experts_spec, row_nbytes


#: The overlap's compute stand-ins (``--host-compute``): the host idles, or runs Python.
HOST_COMPUTE = {"idle": time.sleep, "python": run_python}


def _overlap_step(reader: Reader, step, args, compute_s: float) -> dict:
    """One training step's streamed loop with ``compute_s`` of compute per micro-batch, against that compute."""
    timed = stream_pass(reader, step, args, 0, 0, compute_s, HOST_COMPUTE[args.host_compute])
    loop, steps = timed.seconds, timed.steps
    computed = sum(c for _, c in steps)
    waits = [w for w, _ in steps]
    later = sum(c for _, c in steps[1:])  # past the first micro-batch: its planning and fetch nothing can hide
    return {"ratio": round(loop / computed, 4), "after_first": round((later + sum(waits[1:])) / later, 4),
            "step_s": round(loop, 4), "compute_alone_s": round(computed, 4),
            "first_wait_ms": round(waits[0] * 1e3, 2), "open_ms": round(timed.opened * 1e3, 2),
            "later_waits_ms": round(sum(waits[1:]) * 1e3, 2)}


# -- memory: one reader in a fresh process per (path, scale) ----------------------------

def _rss_child(conn, membership, config, shard, args, path: str) -> None:
    from gputq.client.clients import UnitClients

    trainer_runtime()  # before the baseline: a trainer's torch is not the reader's memory
    with UnitClients(membership, config) as clients, Reader(clients, config) as reader:
        # Anonymous memory only: over shm the arena pages a reader touches count in its RSS too,
        # yet they are the unit's (shared, never copied); sampled, since no counter keeps its peak.
        start, peak, done = _status_kib("RssAnon"), [0], threading.Event()

        def sample():
            while not done.wait(0.001):
                peak[0] = max(peak[0], _status_kib("RssAnon"))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            if path == "stream":
                stream_pass(reader, shard, args, 0, 0)
            else:
                reader.fetch(shard)
            peak[0] = max(peak[0], _status_kib("RssAnon"))
        finally:
            done.set()
            sampler.join()
    conn.send((peak[0] - start) * 1024)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_rss(clients, config, shard, args, path: str) -> int:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    membership = {u: clients.membership[u] for u in clients.units}
    proc = ctx.Process(target=_rss_child, args=(child, membership, config, shard, args, path), daemon=True)
    proc.start()
    try:
        if not parent.poll(600):
            raise RuntimeError(f"the {path} reader process did not finish within 600 s")
        return parent.recv()
    finally:
        proc.join(30)


@contextlib.contextmanager
def _frozen_gc():
    """The objects alive now frozen out of collections, as a trainer's startup objects (see the module
    docstring), until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _bytes_figures(reader: Reader, clients, shards: list, args) -> dict:
    """Every rank of every DP group against the group's whole-shard fetch: the bytes each moved."""
    rows, shares = [], []
    for dp, shard in enumerate(shards):
        before = bytes_read(clients)
        reader.fetch(shard)
        whole = bytes_read(clients) - before
        group = 0
        for rank in progress_range(f"bytes, DP rank {dp}", args.pp * args.cp):
            pp, cp = divmod(rank, args.cp)
            before = bytes_read(clients)
            planned = stream_pass(reader, shard, args, pp, cp).planned
            moved = bytes_read(clients) - before
            group += moved
            rows.append({"rank": f"dp{dp}/pp{pp}/cp{cp}", "moved_MiB": round(moved / MIB, 2),
                         "whole_shard_MiB": round(whole / MIB, 2), "share": round(moved / whole, 4),
                         "exactly_the_slice": moved == planned})
        shares.append(group / (args.pp * args.cp) / whole)
    return {"bytes_rows": rows,
            "bytes_ratio_vs_whole_shard": round(max(shares, key=lambda r: abs(r * args.pp * args.cp - 1)), 5),
            "bytes_goal": round(1 / (args.pp * args.cp), 5),
            "every_rank_exactly_its_slice": all(r["exactly_the_slice"] for r in rows)}


def _overlap_figures(reader: Reader, stored: list, loop_s: float, args) -> dict:
    """Training steps over ``stored`` cycled to ``--step-samples``, with compute (twice the fetch+restore of
    a micro-batch of the throughput pass that took ``loop_s``, or ``--overlap-compute-ms``)."""
    step = [stored[i % len(stored)] for i in range(args.step_samples)] or stored
    per_mb_s = loop_s / len(micro_batches(len(stored), args.mb_samples))
    compute_s = args.overlap_compute_ms / 1e3 or 2 * per_mb_s
    with _switch_interval(args.switch_interval_ms):
        interval_ms = sys.getswitchinterval() * 1e3
        trained = [_overlap_step(reader, step, args, compute_s)
                   for _ in progress_range("overlap, training steps", args.overlap_steps)]
    typical = sorted(trained, key=lambda t: t["ratio"])[len(trained) // 2]
    overlap = {"step_samples": len(step), "micro_batches": len(micro_batches(len(step), args.mb_samples)),
               "compute_ms": round(compute_s * 1e3, 2),
               "compute": "fixed" if args.overlap_compute_ms else "twice the fetch+restore",
               "host_compute": args.host_compute, "switch_interval_ms": round(interval_ms, 3),
               "fetch_restore_ms": round(per_mb_s * 1e3, 2), "steps": len(trained),
               **{k: v for k, v in typical.items() if k not in ("ratio", "after_first")},
               "step_ratios": [t["ratio"] for t in trained]}
    return {"overlap": overlap, "overlap_ratio": typical["ratio"],
            "overlap_ratio_after_first": statistics.median(t["after_first"] for t in trained)}


@contextlib.contextmanager
def _switch_interval(ms: float):
    """The interpreter's switch interval set to ``ms`` (0: left as it is) for the block, then restored."""
    before = sys.getswitchinterval()
    if ms:
        sys.setswitchinterval(ms / 1e3)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _memory_figures(clients, config, shards: dict, scales: list, args) -> dict:
    """Fresh reader processes, streamed and whole-shard, at each scale: their peak memory."""
    memory = []
    for run in progress_range("memory, fresh readers", 2 * len(scales)):
        s, path = scales[run // 2], ("stream", "whole")[run % 2]
        peak = _peak_rss(clients, config, shards[s][0], args, path)
        memory.append({"scale": s, "path": path, "peak_rss_MiB": round(peak / MIB, 1)})
    stream_peaks = {r["scale"]: r["peak_rss_MiB"] for r in memory if r["path"] == "stream"}
    return {"memory_rows": memory, "peak_growth_4x": round(stream_peaks[max(scales)] / stream_peaks[scales[0]], 3)}


def _buffer_figures(reader: Reader, first: list, args) -> dict:
    """The stream's buffers over ``first`` (the smallest scale's shard), and the widened shard against them."""
    with reader.stream(first, micro_batches(len(first), args.mb_samples), rank_slice(args, 0, 0),
                       prefetch=args.prefetch) as stream:
        buffers = stream.buffer_bytes
    whole_widened = sum(layout.nbytes for sample in first for layout in sample.values())
    return {"stream_buffers_MiB": round(buffers / MIB, 2),
            "shard_vs_stream_buffers": round(whole_widened / buffers, 1)}


def run(args) -> dict:
    scales = [int(s) for s in args.scales.split(",")]
    samples_total = args.dp * args.samples * max(scales)
    row_bytes = row_nbytes(routed_experts_spec(args.layers, args.topk, args.dtype, EXPERTS))
    sample_bytes = (args.tokens - 1) * row_bytes + args.tokens * 2
    config = GputqConfig(transport=args.transport, num_units=args.units, routed_experts_dtype=args.dtype,
                         num_experts=EXPERTS,
                         unit_capacity_bytes=int(samples_total * sample_bytes * 1.2 / args.units) + 64 * MIB,
                         host="127.0.0.1")
    result: dict = {"dp": args.dp, "pp": args.pp, "cp": args.cp, "tokens": args.tokens, "layers": args.layers,
                    "topk": args.topk, "dtype": args.dtype, "samples_per_dp_rank": args.samples,
                    "mb_samples": args.mb_samples, "prefetch": args.prefetch, "step_samples": args.step_samples}
    with contextlib.ExitStack() as stack, remote_units(config) as (config, clients), \
            Writer(clients, config) as writer:
        segments = rollout(writer, samples_total, args.tokens, args.layers, args.topk)
        stack.enter_context(_frozen_gc())
        transport = "+".join(sorted({clients.transport_of(u)[0] for u in clients.units}))
        result["transport"] = transport
        shards = {s: [[segments[i] for i in range(d, args.dp * args.samples * s, args.dp)] for d in range(args.dp)]
                  for s in scales}
        with Reader(clients, config) as reader:
            result.update(_bytes_figures(reader, clients, shards[scales[0]], args))  # scale 1
            speed = []  # throughput and overlap: rank dp0/pp0/cp0 over each scale's shard
            for s in scales:
                row = throughput(reader, clients, config, shards[s][0], args, transport, args.repeats)
                speed.append({"scale": s, **{k: v for k, v in row.items() if k != "loop_s"}})
                if s == max(scales):  # the most micro-batches: the first one's fetch, never hidden, weighs least
                    result.update(_overlap_figures(reader, shards[s][0], row["loop_s"], args))
            result["throughput_rows"] = speed
            result.update(throughput_summary(speed))
            result.update(_buffer_figures(reader, shards[scales[0]][0], args))
        result.update(_memory_figures(clients, config, shards, scales, args))
    return result


def _parse(argv) -> argparse.Namespace:
    """The command line, checked."""
    parser = argparse.ArgumentParser(prog="python -m bench.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--transport", choices=("tcp", "shm", "rdma", "auto"), default="tcp")
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--dtype", choices=("uint8", "uint16", "int32", "packed"), default="uint16",
                        help="stored expert IDs (packed: 7 bits, IDs below 128)")
    parser.add_argument("--samples", type=int, default=8, help="segments per DP rank at scale 1")
    parser.add_argument("--mb-samples", type=int, default=2, help="segments per micro-batch")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--scales", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-samples", type=int, default=128,
                        help="segments per DP rank in the overlap's training step (0: the largest stored shard)")
    parser.add_argument("--overlap-steps", type=int, default=5,
                        help="training steps the overlap is timed over (its figure is the median step's)")
    parser.add_argument("--overlap-compute-ms", type=float, default=0.0,
                        help="the compute stand-in per micro-batch of the overlap (0: twice its fetch+restore, "
                             "the goal's)")
    parser.add_argument("--host-compute", choices=tuple(HOST_COMPUTE), default="idle",
                        help="what the host does for the overlap's compute: idles, as while a GPU computes "
                             "(the goal's), or runs Python, holding the GIL")
    parser.add_argument("--switch-interval-ms", type=float, default=0.0,
                        help="the interpreter's switch interval over the overlap's steps (0: as it is)")
    parser.add_argument("--figures", default="docs/figures", help="where the memory plot goes ('' for none)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.layers % args.pp:
        parser.error(f"--layers {args.layers} does not split into --pp {args.pp} stages")
    if args.step_samples < 0:
        parser.error(f"--step-samples must be >= 0, got {args.step_samples}")
    if args.overlap_steps < 1:
        parser.error(f"--overlap-steps must be >= 1, got {args.overlap_steps}")
    if not args.overlap_compute_ms >= 0:
        parser.error(f"--overlap-compute-ms must be >= 0, got {args.overlap_compute_ms}")
    if not args.switch_interval_ms >= 0:
        parser.error(f"--switch-interval-ms must be >= 0, got {args.switch_interval_ms}")
    return args


def main(argv=None) -> None:
    args = _parse(argv)
    runtime = trainer_runtime()
    print_header("gputq trainer side: streamed slices per rank", trainer=runtime,
                 layout=f"DP {args.dp} x PP {args.pp} x CP {args.cp}",
                 segment=f"{args.tokens} tokens, R3 [T-1, {args.layers}, {args.topk}] {args.dtype} + logprobs",
                 samples_per_dp_rank=args.samples, mb_samples=args.mb_samples, prefetch=args.prefetch,
                 step_samples=args.step_samples or "the largest stored shard", overlap_steps=args.overlap_steps,
                 overlap_compute=(f"{args.overlap_compute_ms} ms" if args.overlap_compute_ms
                                  else "twice the fetch+restore") + f", host {args.host_compute}",
                 switch_interval=(f"{args.switch_interval_ms} ms over the overlap" if args.switch_interval_ms
                                  else f"{sys.getswitchinterval() * 1e3:g} ms"),
                 transport=args.transport, units=args.units, scales=args.scales, device="cpu",
                 gc="objects alive after setup frozen (gc.freeze)")
    result = run(args)
    _report(result)
    if args.figures:
        for path in write_figures(trainer_memory_figure, result, args.figures):
            print(f"figure: {path}")
    if args.json:
        emit_json(result)


def _report(result: dict) -> None:
    """The tables and the goals' figures, as they print."""
    print_table(result["bytes_rows"], list(result["bytes_rows"][0]))
    print(f"bytes_ratio_vs_whole_shard (DP group mean share): {result['bytes_ratio_vs_whole_shard']}  "
          f"(goal {result['bytes_goal']} +-1%); every rank moved exactly its slice: "
          f"{result['every_rank_exactly_its_slice']}")
    print_table(result["memory_rows"], list(result["memory_rows"][0]))
    print(f"peak_growth_4x (streamed): {result['peak_growth_4x']}  (goal <= 1.10); shard at 1x is "
          f"{result['shard_vs_stream_buffers']}x the stream's buffers ({result['stream_buffers_MiB']} MiB)")
    print_table(result["throughput_rows"], list(result["throughput_rows"][0]))
    goal = 0.8 if result["transport"] == "shm" else 0.9
    print(f"min stream vs baseline (slices >= 16 MiB): {result['throughput_ratio']}  (goal >= {goal}); "
          f"the ceiling (no gputq) reaches {result['ceiling_vs_baseline']} of the baseline, the stream "
          f"{result['stream_vs_ceiling']} of the ceiling")
    if "second_half_vs_ceiling" in result:
        print(f"the later half of a pass's micro-batches (its opening and first fetches behind it) keeps "
              f"{result['second_half_vs_ceiling']} of the ceiling's pace")
    if "one_thread_widen_vs_ceiling" in result:
        print(f"one thread widening the same bytes (as the stream's restore does) reaches "
              f"{result['one_thread_widen_vs_ceiling']} of the ceiling")
    if "restores_vs_ceiling" in result:
        print(f"the stream's restores alone (one thread, leased before the clock) reach "
              f"{result['restores_vs_ceiling']} of the ceiling, the stream {result['stream_vs_restores']} of them")
    last = result["throughput_rows"][-1]
    if "stream_restore_thread_us_per_MiB" in last:
        alone = f"; its restores alone {round(MIB / (last['restores_GBps'] * 1e3))} on one thread" \
            if last.get("restores_GBps") else ""
        print(f"the receiver's CPU a MiB by thread at scale {last['scale']}: "
              + ", ".join(f"{stage.replace('_', ' ')} {last[f'stream_{stage}_us_per_MiB']}" for stage in STAGE_THREADS)
              + f" of {last['stream_receiver_us_per_MiB']} us{alone}")
    if "reads_vs_baseline" in result:
        print(f"the stream's reads alone reach {result['reads_vs_baseline']} of the baseline, the stream "
              f"{result['stream_vs_reads']} of its reads alone")
    print(f"overlap: {result['overlap']}")
    print(f"overlap_ratio (the median of {result['overlap']['steps']} steps): {result['overlap_ratio']}  "
          f"(goal <= 1.05); after the first micro-batch: {result['overlap_ratio_after_first']}; the first waited "
          f"{result['overlap']['first_wait_ms']} ms, {result['overlap']['open_ms']} of them opening the stream "
          f"(every micro-batch checked and sized before the first read)")


if __name__ == "__main__":
    main()
