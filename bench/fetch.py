"""Fetch one data-parallel shard through gputq and compare with a plain socket.

``python -m bench.fetch [--sizes 16,64,256] [--transport tcp] [--json]``

For each shard size, StorageUnits run in this process (their servers on
their own threads, over loopback); a writer stores R3-shaped steps; a
reader fetches the shard (one batched read per unit and field) and
restores it. The baseline is a plain socket moving the same byte count
with ``sendall``/``recv_into`` to a server in a child process, in the same
run, each socket read right before a fetch; the ratio is the median of
these pairs. A single-thread host memcpy of the same bytes is timed beside
each fetch too: the anchor of the same-host path (``--transport shm``).

``fetch+restore`` (and the ratio) is timed here, from the call of
``Reader.fetch`` to its return: planning, lease, transfer, completion and
widen+scatter (numpy on the CPU, the CUDA kernel with ``--device cuda``).
``fetch`` is the transfer part alone, as the reader's own stats time it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.common import SocketBaseline, add_json_flag, progress_range, emit_json, gbps, print_header, print_table
from gputq.config import GputqConfig
from gputq.deploy import local_cluster
from gputq.reader import Reader
from gputq.refs import Layout
from gputq.writer import Writer

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


def run(args) -> dict:
    sizes = [int(s) * _MIB for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for size in sizes:
        config = GputqConfig(transport=args.transport, num_units=args.units,
                             unit_capacity_bytes=int(size * 1.25 / args.units) + 16 * _MIB,
                             routed_experts_dtype=args.dtype, host="127.0.0.1")
        with local_cluster(config) as (config, _, clients), Writer(clients, config) as writer, \
                Reader(clients, config, device=args.device) as reader:
            shard = _shard(writer, size, args.rows_per_step, args.layers, args.topk, args.dtype, rng)
            reader.fetch(shard)  # warm-up: connections, buffers
            nbytes = reader.last_stats.bytes_fetched
            fetch_s, total_s, socket_s, memcpy_s = [], [], [], []
            copy_src, copy_dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
            with SocketBaseline(nbytes) as baseline:
                baseline.read(nbytes)
                for _ in progress_range(f"fetch {size // _MIB} MiB", args.repeats):
                    socket_s.append(baseline.read(nbytes))
                    started = time.perf_counter()
                    np.copyto(copy_dst, copy_src)
                    memcpy_s.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    reader.fetch(shard)
                    total_s.append(time.perf_counter() - started)
                    fetch_s.append(reader.last_stats.fetch_seconds)
            transports = sorted({clients.transport_of(u)[0] for u in clients.units})
        fetch, total, sock, memcpy = (statistics.median(x) for x in (fetch_s, total_s, socket_s, memcpy_s))
        # Each fetch is paired with the socket read just before it, so the ratio sees the
        # same machine state (this box's loopback speed drifts by 30% between seconds).
        paired = statistics.median(s / t for s, t in zip(socket_s, total_s))
        rows.append({"shard_MiB": round(nbytes / _MIB, 1), "samples": len(shard), "transport": "+".join(transports),
                     "socket_GBps": round(gbps(nbytes, sock), 2), "fetch_GBps": round(gbps(nbytes, fetch), 2),
                     "fetch+restore_GBps": round(gbps(nbytes, total), 2),
                     "ratio_vs_socket": round(paired, 3), "memcpy_GBps": round(gbps(nbytes, memcpy), 2),
                     "ratio_vs_memcpy": round(statistics.median(m / f for m, f in zip(memcpy_s, fetch_s)), 3)})
    big = [r["ratio_vs_socket"] for r in rows if r["shard_MiB"] >= 16]
    return {"rows": rows, "ratio_vs_socket": min(big) if big else None,
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
    add_json_flag(parser)
    args = parser.parse_args(argv)
    print_header("gputq shard fetch vs plain socket", sizes_MiB=args.sizes, transport=args.transport,
                 units=args.units, dtype=args.dtype, row=f"L={args.layers} K={args.topk}",
                 device=args.device, repeats=args.repeats)
    result = run(args)
    print_table(result["rows"], list(result["rows"][0]))
    print(f"min ratio vs plain socket (shards >= 16 MiB): {result['ratio_vs_socket']}")
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
