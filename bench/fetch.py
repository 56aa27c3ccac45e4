"""Fetch one data-parallel shard through gputq and compare with a plain socket and a memcpy.

``python -m bench.fetch [--sizes 16,64,256] [--transport tcp|shm|rdma] [--dtype uint16,packed] [--experts E]
[--json]``

For each shard size, StorageUnits run in child processes, as in a
deployment (their servers over loopback); a writer stores R3-shaped steps;
a reader fetches the shard (one batched read per unit) and restores it.
Three baselines move the same byte count in the same run, each timed right
before every fetch: a plain socket (``sendall``/``recv_into`` from a
server in a child process), the reference of the tcp and rdma paths, and a
host memcpy between two warm (already touched) buffers, the reference of the
same-host path (shm), on as many threads as gputq copies with
(:func:`~bench.common.same_host_copy_threads` for a whole-shard read; the
fetch and restore threads for a stream) and, for reference, on one.

``fetch+restore`` is timed from the call of ``Reader.fetch`` to its
return: planning, lease, transfer, confirmation and widen+scatter (numpy
on the CPU, the CUDA kernel with ``--device cuda``): the time a trainer
waits. ``fetch`` is the transfer part alone, as the reader's own stats
time it. Over shm a restore can read the compact bytes in place, straight
from the arena mapping, with no staging copy (``in place``); the ``copy``
row stages them first (``zero_copy_max_bytes=0``: on the host, a copy of
the arena in spans), which is the row whose ``fetch`` compares with the
memcpy. Ratios are medians of the paired runs.

Goals, per row, for shards of 16 MiB and more: over tcp (and rdma),
fetch+restore at least 0.9x the plain socket; over shm, fetch+restore at
least 0.8x the memcpy on the same threads. The ``goal`` column and the JSON
line's ``goal_met`` say whether every such row met its goal.

Each pass also times a **ceiling**, with no gputq in it: the same bytes
restored from the plainest parts. Over tcp and rdma, the plain
socket read in requests of :data:`CEILING_CHUNK_BYTES`, each widened to
int32 as it lands, 64 KiB at a time, on the receiving thread
(:class:`~bench.common.SocketWidened`); over shm, the bytes widened to
int32 on the memcpy's threads. ``ceiling_vs_goal_base`` is its ratio to
the goal's baseline: below the goal's factor, the goal asks more of this
machine than a bare socket (or memory) plus numpy's widen gives.
``total_vs_ceiling`` is gputq's fraction of it.

``--dtype`` may name several stored formats (``uint16,packed``): each
then stores the same steps (the shard size counts in the first one's
bytes), and ``out_GBps`` (restored int32 and float32 bytes a second) of
each row is compared with the first format's row of the same shard and path
(``out_vs_first``): packed IDs against uint16, per output byte. IDs are
drawn below ``--experts``, which packed IDs are packed for.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from bench.common import (
    SocketBaseline,
    SocketWidened,
    add_json_flag,
    emit_json,
    gbps,
    print_header,
    print_table,
    progress_range,
    remote_units,
    same_host_copy_threads,
    threaded_memcpy,
    trainer_runtime,
)
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.config import GputqConfig
from gputq.data.fields import ROUTED_EXPERTS_FORMATS, routed_experts_spec, row_nbytes
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice

_MIB = 1 << 20
#: A stream's threads: it fetches the next micro-batch on one while it restores the current on the other.
STREAM_THREADS = 2
#: fetch+restore over the baseline of the row's transport, for shards of GOAL_MIN_MIB and more.
GOALS = {"tcp": ("socket", 0.9), "rdma": ("socket", 0.9), "shm": ("memcpy", 0.8)}
GOAL_MIN_MIB = 16
#: The default ``--experts``.
_EXPERTS = 128
_WHOLE = ("uint8", "uint16", "int32")
#: Bytes per read of the tcp ceiling: a stream's micro-batch of a 64K-token segment's stage slice.
CEILING_CHUNK_BYTES = 4 << 20


def _steps(size: int, rows_per_step: int, layers: int, topk: int, dtype: str, experts: int) -> int:
    """Steps of ``rows_per_step`` rows that store ``size`` bytes in ``dtype`` (experts + one float32 logprob)."""
    row_bytes = row_nbytes(routed_experts_spec(layers, topk, dtype, experts)) + 4
    return max(1, -(-size // (rows_per_step * row_bytes)))


def _shard(writer: Writer, steps: int, rows_per_step: int, layers: int, topk: int, experts: int, rng, tag: str):
    shard = []
    for i in range(steps):
        experts_ids = rng.integers(0, experts, size=(rows_per_step, layers, topk), dtype=np.int32)
        logprobs = -rng.random(rows_per_step, dtype=np.float32)
        refs = writer.put(f"bench/{tag}/{i}", "bench", {"routed_experts": experts_ids, "logprobs": logprobs})
        shard.append({field: Layout.from_ref(ref) for field, ref in refs.items()})
    writer.flush()
    return shard


def _stream_pass(reader: Reader, shard, mb_samples: int, experts: int) -> None:
    """Every sample of ``shard``, whole, streamed in micro-batches of ``mb_samples`` (pad rows below ``experts``,
    the count the IDs were drawn, and packed, for)."""
    batches = [list(range(i, min(len(shard), i + mb_samples))) for i in range(0, len(shard), mb_samples)]
    with reader.stream(shard, batches, ParallelSlice(num_experts=experts)) as stream:
        for _ in stream:
            pass


def _time_fetches(reader: Reader, shard, nbytes: int, baseline: SocketBaseline, repeats: int, label: str,
                  threads: int, ceiling, mb_samples: int | None = None, experts: int = _EXPERTS):
    """``repeats`` fetches, each paired with a socket read, memcpys of ``nbytes`` and the ``ceiling``
    (a callable that times it) just before it.

    The memcpys run on ``threads`` threads and on one. With ``mb_samples``
    each fetch is a stream of the shard in micro-batches.
    """
    copy_src, copy_dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)  # touched: no first-touch faults
    times: dict[str, list[float]] = {"fetch": [], "total": [], "socket": [], "memcpy": [], "memcpy1": [],
                                     "ceiling": []}
    run = reader.fetch if mb_samples is None else (lambda s: _stream_pass(reader, s, mb_samples, experts))
    run(shard)  # warm-up: connections, buffers, this path's first touch
    for _ in progress_range(label, repeats):
        times["socket"].append(baseline.read(nbytes))
        times["memcpy"].append(threaded_memcpy(copy_dst, copy_src, threads))
        times["memcpy1"].append(threaded_memcpy(copy_dst, copy_src, 1))
        times["ceiling"].append(ceiling(threads))
        started = time.perf_counter()
        run(shard)
        times["total"].append(time.perf_counter() - started)
        times["fetch"].append(reader.last_stats.fetch_seconds if mb_samples is None else math.nan)
    return times


def _row(path: str, transport: str, samples: int, nbytes: int, times: dict, threads: int,
         no_transfer_apart: bool, dtype: str, out_bytes: int) -> dict:
    fetch, total, sock, memcpy, memcpy1 = (statistics.median(times[k])
                                           for k in ("fetch", "total", "socket", "memcpy", "memcpy1"))
    # Paired with the baselines timed just before each fetch, so a ratio sees one machine state
    # (this box's loopback speed drifts by 30% between seconds).
    paired = lambda base, timed: round(statistics.median(b / t for b, t in zip(times[base], times[timed])), 3)
    row = {"shard_MiB": round(nbytes / _MIB, 1), "samples": samples, "transport": transport, "path": path,
           "dtype": dtype, "out_GBps": round(gbps(out_bytes, total), 2),
           "socket_GBps": round(gbps(nbytes, sock), 2), "threads": threads,
           "memcpy_GBps": round(gbps(nbytes, memcpy), 2), "memcpy1_GBps": round(gbps(nbytes, memcpy1), 2),
           # in place, the transfer is the restore's own reads: there is no fetch apart from it
           "fetch_GBps": None if no_transfer_apart else round(gbps(nbytes, fetch), 2),
           "fetch+restore_GBps": round(gbps(nbytes, total), 2),
           "ratio_vs_socket": paired("socket", "total"),
           "fetch_vs_memcpy": None if no_transfer_apart else paired("memcpy", "fetch"),
           "total_vs_memcpy": paired("memcpy", "total"), "total_vs_memcpy1": paired("memcpy1", "total")}
    base, floor = GOALS.get(transport, ("socket", 0.9))
    row["ceiling_GBps"] = round(gbps(nbytes, statistics.median(times["ceiling"])), 2)
    row["ceiling_vs_goal_base"] = paired(base, "ceiling")
    row["total_vs_ceiling"] = paired("ceiling", "total")
    ratio = row["ratio_vs_socket" if base == "socket" else "total_vs_memcpy"]
    row["goal"] = (f"{'met' if ratio >= floor else 'missed'} ({ratio:.2f} vs {floor}x {base})"
                   if row["shard_MiB"] >= GOAL_MIN_MIB else "n/a (< 16 MiB)")
    return row


def _ceiling(transport: str, baseline: SocketBaseline, nbytes: int, ids: np.dtype):
    """The row's ceiling as a callable of the memcpy's thread count, returning its seconds (see above)."""
    if transport == "shm":
        compact, widened = np.ones(nbytes // ids.itemsize, ids), np.ones(nbytes // ids.itemsize, np.int32)
        return lambda threads: threaded_memcpy(widened, compact, threads)
    widening = SocketWidened(baseline, min(CEILING_CHUNK_BYTES, nbytes), ids)
    widening.read(nbytes)  # warm: its buffers

    def timed(_threads: int) -> float:
        started = time.perf_counter()
        widening.read(nbytes)
        return time.perf_counter() - started
    return timed


def _summary(rows: list[dict]) -> dict:
    """The smallest ratio of each kind over shards of at least :data:`GOAL_MIN_MIB`, and the goals."""
    big = [r for r in rows if r["shard_MiB"] >= GOAL_MIN_MIB]

    def least(key, path=None):
        values = [r[key] for r in big if r[key] is not None and (path is None or r["path"] == path)]
        return min(values) if values else None

    goals = {path: all(r["goal"].startswith("met") for r in big if r["path"] == path)
             for path in sorted({r["path"] for r in big})}
    first = rows[0]["dtype"] if rows else None
    for row in rows:  # each format's restored bytes a second against the first format's, same shard and path
        base = next(r for r in rows if r["dtype"] == first and r["path"] == row["path"] and
                    r["samples"] == row["samples"])
        row["out_vs_first"] = round(row["out_GBps"] / base["out_GBps"], 3) if base["out_GBps"] else None
    return {"ratio_vs_socket": least("ratio_vs_socket"), "fetch_vs_memcpy": least("fetch_vs_memcpy"),
            "total_vs_memcpy": least("total_vs_memcpy"), "total_vs_memcpy1": least("total_vs_memcpy1"),
            "stream_vs_socket": least("ratio_vs_socket", "stream"),
            "stream_vs_memcpy": least("total_vs_memcpy", "stream"),
            "ceiling_vs_goal_base": least("ceiling_vs_goal_base"), "total_vs_ceiling": least("total_vs_ceiling"),
            "goal_met": goals, "goal_met_all": bool(big) and all(goals.values())}


def run(args) -> dict:
    sizes = [int(s) * _MIB for s in args.sizes.split(",")]
    dtypes = args.dtype.split(",")
    rng = np.random.default_rng(0)
    rows = []
    for size in sizes:
        steps = _steps(size, args.rows_per_step, args.layers, args.topk, dtypes[0], args.experts)
        for dtype in dtypes:
            rows += _run_format(args, size, steps, dtype, rng)
    return {"rows": rows, **_summary(rows), "dtype": args.dtype, "experts": args.experts, "layers": args.layers,
            "topk": args.topk, "units": args.units, "repeats": args.repeats, "device": args.device}


def _run_format(args, size: int, steps: int, dtype: str, rng) -> list[dict]:
    """The rows of one shard size stored in one format: each path's paired fetches."""
    rows = []
    config = GputqConfig(transport=args.transport, num_units=args.units,
                         unit_capacity_bytes=int(size * 1.25 / args.units) + 16 * _MIB,
                         routed_experts_dtype=dtype, num_experts=args.experts, host="127.0.0.1")
    with remote_units(config) as (config, clients), Writer(clients, config) as writer:
        shard = _shard(writer, steps, args.rows_per_step, args.layers, args.topk, args.experts, rng, f"{size}/{dtype}")
        out_bytes = steps * args.rows_per_step * (args.layers * args.topk + 1) * 4
        with Reader(clients, config, device=args.device) as reader:
            reader.fetch(shard)
            nbytes = reader.last_stats.bytes_fetched
        transports = "+".join(sorted({clients.transport_of(u)[0] for u in clients.units}))
        paths = [("copy", 0.0), ("in place", math.inf)] if transports == "shm" else [("copy", None)]
        label = f"{size // _MIB} MiB {dtype}"
        with SocketBaseline(nbytes) as baseline:
            baseline.read(nbytes)
            threads = same_host_copy_threads(args.units)
            ceiling = _ceiling(transports, baseline, nbytes, np.dtype(dtype if dtype in _WHOLE else "uint8"))
            for path, zero_copy_max in paths:
                path_config = config if zero_copy_max is None else config.replace(zero_copy_max_bytes=zero_copy_max)
                with Reader(clients, path_config, device=args.device) as reader:
                    times = _time_fetches(reader, shard, nbytes, baseline, args.repeats, f"fetch {label} {path}",
                                          threads, ceiling)
                rows.append(_row(path, transports, len(shard), nbytes, times, threads, path == "in place", dtype,
                                 out_bytes))
            with Reader(clients, config, device=args.device) as reader:
                times = _time_fetches(reader, shard, nbytes, baseline, args.repeats, f"stream {label}",
                                      STREAM_THREADS, ceiling, mb_samples=args.mb_samples, experts=args.experts)
            # A stream's transfers overlap its restores: there is no fetch to time apart.
            rows.append(_row("stream", transports, len(shard), nbytes, times, STREAM_THREADS, True, dtype, out_bytes))
    return rows


def _formats(text: str) -> str:
    unknown = [d for d in text.split(",") if d not in ROUTED_EXPERTS_FORMATS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown formats {unknown}; known: {ROUTED_EXPERTS_FORMATS}")
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fetch", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64,256", help="shard sizes in MiB, comma separated")
    parser.add_argument("--transport", choices=("tcp", "shm", "rdma", "auto"), default="tcp")
    parser.add_argument("--units", type=int, default=1)
    parser.add_argument("--dtype", type=_formats, default="uint16",
                        help=f"stored expert-ID formats, comma separated, of {ROUTED_EXPERTS_FORMATS}")
    parser.add_argument("--experts", type=int, default=_EXPERTS, help="IDs drawn below it (packed: E)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--rows-per-step", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu", help="restore into cpu or cuda memory")
    parser.add_argument("--mb-samples", type=int, default=1, help="steps per micro-batch of the stream row")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    runtime = trainer_runtime()
    print_header("gputq shard fetch vs plain socket and memcpy", trainer=runtime, sizes_MiB=args.sizes,
                 transport=args.transport, units=args.units, dtype=args.dtype, row=f"L={args.layers} K={args.topk}",
                 device=args.device, repeats=args.repeats,
                 memcpy_threads=f"{same_host_copy_threads(args.units)} whole-shard, {STREAM_THREADS} stream, and 1")
    result = run(args)
    print_table(result["rows"], list(result["rows"][0]))
    print("  threads: the memcpy baseline's (memcpy_GBps); memcpy1_GBps: one thread, for reference")
    print(f"min fetch+restore vs plain socket (shards >= 16 MiB): {result['ratio_vs_socket']}  (tcp goal >= 0.9)")
    print(f"min fetch+restore vs memcpy on the same threads (shards >= 16 MiB): {result['total_vs_memcpy']}  "
          f"(shm goal >= 0.8); vs one thread: {result['total_vs_memcpy1']}")
    if result["fetch_vs_memcpy"] is not None:
        print(f"min fetch alone vs memcpy on the same threads (shards >= 16 MiB): {result['fetch_vs_memcpy']}")
    print(f"the ceiling (no gputq: a host widen behind the wire) vs the goal's baseline (shards >= 16 MiB): "
          f"{result['ceiling_vs_goal_base']}; fetch+restore vs the ceiling: {result['total_vs_ceiling']}")
    print(f"goal met per path: {result['goal_met']}")
    if len(args.dtype.split(",")) > 1:
        print(f"restored bytes a second against {args.dtype.split(',')[0]}'s (out_vs_first): "
              + ", ".join(f"{r['dtype']} {r['path']} {r['out_vs_first']}" for r in result["rows"]))
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
