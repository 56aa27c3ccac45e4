"""Fetch one data-parallel shard through gputq and compare with a plain socket and a memcpy.

``python -m bench.fetch [--sizes 16,64,256] [--transport tcp|shm|rdma] [--json]``

For each shard size, StorageUnits run in child processes, as in a
deployment (their servers over loopback); a writer stores R3-shaped steps;
a reader fetches the shard (one batched read per unit) and restores it.
Two baselines move the same byte count in the same run, each timed right
before every fetch: a plain socket (``sendall``/``recv_into`` from a
server in a child process), the reference of the tcp and rdma paths, and
a single-thread host memcpy, the anchor of the same-host path (shm).

``fetch+restore`` is timed from the call of ``Reader.fetch`` to its
return: planning, lease, transfer, confirmation and widen+scatter (numpy
on the CPU, the CUDA kernel with ``--device cuda``). ``fetch`` is the
transfer part alone, as the reader's own stats time it. Over shm a restore
can read the compact bytes in place, straight from the arena mapping, with
no staging copy (``in place``); the ``copy`` row stages them first
(``zero_copy_max_bytes=0``: on the host, a copy of the arena in spans),
which is the row whose ``fetch`` compares with the memcpy. Ratios are
medians of the paired runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from bench.common import (
    SocketBaseline,
    add_json_flag,
    emit_json,
    gbps,
    print_header,
    print_table,
    progress_range,
    remote_units,
    threaded_memcpy,
)
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.config import GputqConfig
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice

_MIB = 1 << 20


def _shard(writer: Writer, size: int, rows_per_step: int, layers: int, topk: int, dtype: str, rng):
    row_bytes = layers * topk * np.dtype(dtype).itemsize + 4  # experts + one float32 logprob
    steps = max(1, -(-size // (rows_per_step * row_bytes)))
    shard = []
    for i in range(steps):
        experts = rng.integers(0, 128, size=(rows_per_step, layers, topk), dtype=np.int32)
        logprobs = -rng.random(rows_per_step, dtype=np.float32)
        refs = writer.put(f"bench/{size}/{i}", "bench", {"routed_experts": experts, "logprobs": logprobs})
        shard.append({field: Layout.from_ref(ref) for field, ref in refs.items()})
    writer.flush()
    return shard


def _stream_pass(reader: Reader, shard, mb_samples: int) -> None:
    """Every sample of ``shard``, whole, streamed in micro-batches of ``mb_samples``."""
    batches = [list(range(i, min(len(shard), i + mb_samples))) for i in range(0, len(shard), mb_samples)]
    with reader.stream(shard, batches, ParallelSlice(num_experts=128)) as stream:
        for _ in stream:
            pass


def _time_fetches(reader: Reader, shard, nbytes: int, baseline: SocketBaseline, repeats: int, label: str,
                  mb_samples: int | None = None):
    """``repeats`` fetches, each paired with a socket read and a memcpy of ``nbytes`` just before it.

    With ``mb_samples`` each fetch is a stream of the shard in micro-batches, and the memcpy runs
    on as many threads as the stream does (its fetch and restore threads).
    """
    copy_src, copy_dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
    times: dict[str, list[float]] = {"fetch": [], "total": [], "socket": [], "memcpy": []}
    run = reader.fetch if mb_samples is None else (lambda s: _stream_pass(reader, s, mb_samples))
    run(shard)  # warm-up: connections, buffers, this path's first touch
    for _ in progress_range(label, repeats):
        times["socket"].append(baseline.read(nbytes))
        times["memcpy"].append(threaded_memcpy(copy_dst, copy_src, 1 if mb_samples is None else 2))
        started = time.perf_counter()
        run(shard)
        times["total"].append(time.perf_counter() - started)
        times["fetch"].append(reader.last_stats.fetch_seconds if mb_samples is None else math.nan)
    return times


def _row(path: str, transport: str, samples: int, nbytes: int, times: dict, no_transfer_apart: bool) -> dict:
    fetch, total, sock, memcpy = (statistics.median(times[k]) for k in ("fetch", "total", "socket", "memcpy"))
    # Paired with the baselines timed just before each fetch, so a ratio sees one machine state
    # (this box's loopback speed drifts by 30% between seconds).
    paired = lambda base, timed: round(statistics.median(b / t for b, t in zip(times[base], times[timed])), 3)
    return {"shard_MiB": round(nbytes / _MIB, 1), "samples": samples, "transport": transport, "path": path,
            "socket_GBps": round(gbps(nbytes, sock), 2), "memcpy_GBps": round(gbps(nbytes, memcpy), 2),
            # in place, the transfer is the restore's own reads: there is no fetch apart from it
            "fetch_GBps": None if no_transfer_apart else round(gbps(nbytes, fetch), 2),
            "fetch+restore_GBps": round(gbps(nbytes, total), 2),
            "ratio_vs_socket": paired("socket", "total"),
            "fetch_vs_memcpy": None if no_transfer_apart else paired("memcpy", "fetch"),
            "total_vs_memcpy": paired("memcpy", "total")}


def run(args) -> dict:
    sizes = [int(s) * _MIB for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for size in sizes:
        config = GputqConfig(transport=args.transport, num_units=args.units,
                             unit_capacity_bytes=int(size * 1.25 / args.units) + 16 * _MIB,
                             routed_experts_dtype=args.dtype, host="127.0.0.1")
        with remote_units(config) as (config, clients), Writer(clients, config) as writer:
            shard = _shard(writer, size, args.rows_per_step, args.layers, args.topk, args.dtype, rng)
            with Reader(clients, config, device=args.device) as reader:
                reader.fetch(shard)
                nbytes = reader.last_stats.bytes_fetched
            transports = "+".join(sorted({clients.transport_of(u)[0] for u in clients.units}))
            paths = [("copy", 0.0), ("in place", math.inf)] if transports == "shm" else [("copy", None)]
            with SocketBaseline(nbytes) as baseline:
                baseline.read(nbytes)
                for path, zero_copy_max in paths:
                    path_config = config if zero_copy_max is None else config.replace(zero_copy_max_bytes=zero_copy_max)
                    with Reader(clients, path_config, device=args.device) as reader:
                        times = _time_fetches(reader, shard, nbytes, baseline, args.repeats,
                                              f"fetch {size // _MIB} MiB {path}")
                    rows.append(_row(path, transports, len(shard), nbytes, times, path == "in place"))
                with Reader(clients, config, device=args.device) as reader:
                    times = _time_fetches(reader, shard, nbytes, baseline, args.repeats,
                                          f"stream {size // _MIB} MiB", mb_samples=args.mb_samples)
                # A stream's transfers overlap its restores: there is no fetch to time apart.
                rows.append(_row("stream", transports, len(shard), nbytes, times, True))
    big = [r["ratio_vs_socket"] for r in rows if r["shard_MiB"] >= 16]
    copies = [r["fetch_vs_memcpy"] for r in rows if r["fetch_vs_memcpy"] is not None and r["shard_MiB"] >= 16]
    streamed = [r for r in rows if r["path"] == "stream" and r["shard_MiB"] >= 16]
    return {"rows": rows, "ratio_vs_socket": min(big) if big else None,
            "fetch_vs_memcpy": min(copies) if copies else None,
            "stream_vs_socket": min(r["ratio_vs_socket"] for r in streamed) if streamed else None,
            "stream_vs_memcpy": min(r["total_vs_memcpy"] for r in streamed) if streamed else None,
            "dtype": args.dtype, "layers": args.layers, "topk": args.topk, "units": args.units,
            "repeats": args.repeats, "device": args.device}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fetch", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64,256", help="shard sizes in MiB, comma separated")
    parser.add_argument("--transport", choices=("tcp", "shm", "rdma", "auto"), default="tcp")
    parser.add_argument("--units", type=int, default=1)
    parser.add_argument("--dtype", choices=("uint8", "uint16", "int32"), default="uint16")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--rows-per-step", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu", help="restore into cpu or cuda memory")
    parser.add_argument("--mb-samples", type=int, default=1, help="steps per micro-batch of the stream row")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    print_header("gputq shard fetch vs plain socket", sizes_MiB=args.sizes, transport=args.transport,
                 units=args.units, dtype=args.dtype, row=f"L={args.layers} K={args.topk}",
                 device=args.device, repeats=args.repeats)
    result = run(args)
    print_table(result["rows"], list(result["rows"][0]))
    print(f"min fetch+restore vs plain socket (shards >= 16 MiB): {result['ratio_vs_socket']}")
    if result["fetch_vs_memcpy"] is not None:
        print(f"min fetch vs memcpy of the same bytes (shards >= 16 MiB): {result['fetch_vs_memcpy']}")
    print(f"min streamed fetch+restore vs plain socket (shards >= 16 MiB): {result['stream_vs_socket']}  "
          f"(tcp goal >= 0.9); vs memcpy on as many threads: {result['stream_vs_memcpy']}  (shm goal >= 0.8)")
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
