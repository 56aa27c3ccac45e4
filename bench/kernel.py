"""Benchmark the widen+scatter kernel against a device copy and a naive path.

    python -m bench.kernel [--layers 48 --topk 8 --tokens N --samples 64
                            --dtype uint8|uint16|int32|all --steps 2,4,8 --json]

For each staging dtype it builds a realistic shard (ragged samples of
fragments of hundreds to thousands of rows, shuffled sources and plan
order, a few fill fragments) and times, with CUDA events after warm-up,
rotating among three input sets so the 60 MB L2 holds none of them:

- kernel: ``kernels.widen_scatter`` on CUDA torch tensors (the CuPy kernel,
  or the torch fallback when CuPy cannot run), validation included;
- copy: a device-to-device ``copy_`` moving the same bytes (read + written);
- naive: ``staging.to(torch.int32)`` then ``index_copy_`` of the rows.

Packed IDs (``--experts E``, ``ceil(log2 E)`` bits): ``kernels.unpack_scatter``
over the same shard (each token row is ``layers`` packed rows), against a
device copy of its output bytes (goal: at least 0.9x its time), checked
bit for bit against the host codec.

GB/s count the bytes read plus written by the kernel (``plan_bytes``) for
all three, so the ratios are ratios of times.

The host side of a launch (plan validation plus the fragment table of a
1,000-fragment shard, built into a reused buffer) is pure numpy and is
timed on any machine. Without a CUDA device the GPU part is skipped and
says why (``"skipped"`` in the --json line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from gputq import kernels
from gputq.kernels import plan_bytes, widen_scatter
from gputq.kernels.cupy_backend import chunk_elements, fragment_table
from gputq.kernels.plan import check_call, packed_row_bytes, row_gather_indices

__all__ = ["main", "make_shard_plan", "host_side_us", "kernel_result"]

SETS = 3  # input sets rotated through, each far larger than L2
GOAL_VS_COPY = 0.9
GOAL_VS_NAIVE = 3.0
GOAL_HOST_US = 50.0


def make_shard_plan(rng, tokens: int, samples: int) -> tuple[np.ndarray, int]:
    """A plan for one trainer shard: ragged samples back to back in the output.

    Returns the plan and the staging rows it reads. Each sample is cut into
    fragments of 200-4000 rows; about 2% are fill fragments; staging holds
    the copied fragments in shuffled order, and the plan rows are shuffled.
    """
    weights = rng.lognormal(0.0, 0.6, samples)
    counts = np.maximum(1, np.floor(weights / weights.sum() * tokens)).astype(np.int64)
    counts[-1] += tokens - counts.sum()
    frag_rows = []
    for c in counts.tolist():
        while c > 0:
            n = min(c, int(rng.integers(200, 4001)))
            frag_rows.append(n)
            c -= n
    frag_rows = np.array(frag_rows, np.int64)
    dst = np.cumsum(frag_rows) - frag_rows
    is_fill = rng.random(len(frag_rows)) < 0.02
    copy = np.flatnonzero(~is_fill)
    order = rng.permutation(copy)
    src = np.full(len(frag_rows), -1, np.int64)
    src[order] = np.cumsum(frag_rows[order]) - frag_rows[order]
    plan = np.stack([src, dst, frag_rows], axis=1)
    return plan[rng.permutation(len(plan))], int(frag_rows[copy].sum())


def host_side_us(plan, src_rows: int, width: int, dtype: str, repeats: int = 200) -> float:
    """Median microseconds of a launch's host-side work: validation plus the fragment table.

    What :func:`kernels.widen_scatter` does on the CPU before the upload,
    with the table built into a reused buffer as the CuPy backend does.
    """
    dst_rows = int((plan[:, 1] + plan[:, 2]).max())
    out = np.empty(4 * len(plan), np.int64)
    chunk = chunk_elements(np.dtype(dtype).itemsize)
    times = []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        checked, _ = check_call(dtype, src_rows * width, "int32", dst_rows * width, plan, width, 0, True)
        fragment_table(checked, width, chunk, out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e6


def _median_ms(torch, calls, iters: int) -> float:
    """Median per-call GPU time of back-to-back calls, rotating inputs."""
    for i in range(SETS):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        calls[i % len(calls)]()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iters))


def _random_staging(torch, dtype: str, n: int):
    if dtype == "uint8":
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    if dtype == "uint16":  # few CUDA ops accept uint16: draw int16 bits
        return torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device="cuda").view(torch.uint16)
    return torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")


def _widen_naive(torch, staging):
    if staging.dtype == torch.uint16:
        return staging.view(torch.int16).to(torch.int32) & 0xFFFF
    return staging.to(torch.int32)


def bench_dtype(torch, dtype, plan, src_rows, width, iters, steps) -> dict:
    dst_rows = int((plan[:, 1] + plan[:, 2]).max())
    nbytes = plan_bytes(dtype, "int32", plan, width)
    stagings = [_random_staging(torch, dtype, src_rows * width) for _ in range(SETS)]
    outs = [torch.empty(dst_rows * width, dtype=torch.int32, device="cuda") for _ in range(SETS)]

    kernel = [lambda s=s, o=o: widen_scatter(s, plan, width, o) for s, o in zip(stagings, outs)]
    kernel[0]()  # compile and load the module outside every timing
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        kernel[0]()
    host_us = (time.perf_counter() - start) / 10 * 1e6  # enqueue cost, GPU runs behind
    kernel_ms = _median_ms(torch, kernel, iters)

    steps_ms = {}
    if steps:
        from gputq.kernels.cupy_backend import torch_widen_scatter_cupy

        for k in steps:
            calls = [lambda s=s, o=o, k=k: torch_widen_scatter_cupy(s, plan, width, o, steps=k)
                     for s, o in zip(stagings, outs)]
            steps_ms[k] = _median_ms(torch, calls, iters)

    src_idx, dst_idx, fill_idx = (torch.from_numpy(a).cuda() for a in row_gather_indices(plan))

    def naive(s, o):
        o2 = o.view(-1, width)
        o2.index_copy_(0, dst_idx, _widen_naive(torch, s).view(-1, width).index_select(0, src_idx))
        o2.index_fill_(0, fill_idx, 0)

    check = torch.empty_like(outs[0])
    naive(stagings[0], check)
    widen_scatter(stagings[0], plan, width, outs[0])
    match = bool(torch.equal(check, outs[0]))
    del check
    naive_ms = _median_ms(torch, [lambda s=s, o=o: naive(s, o) for s, o in zip(stagings, outs)], iters)
    del stagings, outs

    half = nbytes // 2  # copy_ reads and writes this many bytes
    srcs = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
    dsts = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
    copy_ms = _median_ms(torch, [lambda a=a, b=b: b.copy_(a) for a, b in zip(srcs, dsts)], iters)
    del srcs, dsts
    torch.cuda.empty_cache()

    return kernel_result(nbytes, kernel_ms, copy_ms, naive_ms, host_us, match, steps_ms)


def kernel_result(nbytes: int, kernel_ms: float, copy_ms: float, naive_ms: float, host_us: float, match: bool,
                  steps_ms: dict) -> dict:
    """One dtype's row of the JSON result (what ``bench.gpu_summary`` reads)."""
    gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731 - local shorthand
    return {
        "bytes": nbytes,
        "kernel_ms": kernel_ms,
        "copy_ms": copy_ms,
        "naive_ms": naive_ms,
        "kernel_gbps": gbps(kernel_ms),
        "copy_gbps": gbps(copy_ms),
        "naive_gbps": gbps(naive_ms),
        "ratio_vs_copy": copy_ms / kernel_ms,
        "speedup_vs_naive": naive_ms / kernel_ms,
        "host_us_per_call": host_us,
        "matches_naive": match,
        "steps_gbps": {str(k): gbps(ms) for k, ms in steps_ms.items()},
    }


def packed_row_plan(plan: np.ndarray, layers: int) -> np.ndarray:
    """A token-row plan as a plan of packed rows: a token's ``layers`` rows lie one after the other."""
    rows = plan.astype(np.int64) * layers
    rows[plan[:, 0] < 0, 0] = -1
    return rows


def bench_packed(torch, plan, src_rows: int, layers: int, topk: int, experts: int, iters: int) -> dict:
    """The unpack kernel over ``plan`` (token rows) against a device copy of its output bytes."""
    from gputq.kernels import unpack_scatter
    from gputq.kernels.host_native import unpack_scatter_host

    bits = max(1, (experts - 1).bit_length())
    rows_plan = packed_row_plan(plan, layers)
    dst_rows = int((rows_plan[:, 1] + rows_plan[:, 2]).max())
    out_bytes = dst_rows * topk * 4
    stagings = [torch.randint(0, 256, (src_rows * layers * packed_row_bytes(topk, bits),), dtype=torch.uint8,
                              device="cuda") for _ in range(SETS)]
    outs = [torch.zeros(dst_rows * topk, dtype=torch.int32, device="cuda") for _ in range(SETS)]
    calls = [lambda s=s, o=o: unpack_scatter(s, rows_plan, topk, bits, o) for s, o in zip(stagings, outs)]
    calls[0]()  # compile and load the module outside the timing
    torch.cuda.synchronize()
    kernel_ms = _median_ms(torch, calls, iters)
    want = unpack_scatter_host(stagings[0].cpu().numpy(), rows_plan, topk, bits, np.zeros(dst_rows * topk, np.int32))
    match = bool(np.array_equal(outs[0].cpu().numpy(), want))
    del stagings, outs, want
    srcs = [torch.empty(out_bytes, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
    dsts = [torch.empty(out_bytes, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
    copy_ms = _median_ms(torch, [lambda a=a, b=b: b.copy_(a) for a, b in zip(srcs, dsts)], iters)
    del srcs, dsts
    torch.cuda.empty_cache()
    return {"experts": experts, "bits": bits, "row_bytes": packed_row_bytes(topk, bits), "out_bytes": out_bytes,
            "kernel_ms": kernel_ms, "copy_ms": copy_ms, "kernel_out_gbps": out_bytes / (kernel_ms * 1e-3) / 1e9,
            "copy_out_gbps": out_bytes / (copy_ms * 1e-3) / 1e9, "ratio_vs_copy": copy_ms / kernel_ms,
            "matches_reference": match}


def _launch_us(torch, plan, src_rows: int, width: int = 8, calls: int = 50) -> float:
    """Wall microseconds per widen_scatter call on CUDA tensors (enqueue cost; the GPU runs behind)."""
    dst_rows = int((plan[:, 1] + plan[:, 2]).max())
    staging = _random_staging(torch, "uint8", src_rows * width)
    out = torch.empty(dst_rows * width, dtype=torch.int32, device="cuda")
    widen_scatter(staging, plan, width, out)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        widen_scatter(staging, plan, width, out)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kernel", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2**20, help="rows in the shard's output")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--dtype", choices=["uint8", "uint16", "int32", "all"], default="all")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--steps", default="", help="also time these 16-byte groups per thread, e.g. 2,4,8")
    p.add_argument("--experts", type=int, default=384, help="packed IDs: experts E (0: skip the unpack kernel)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)

    width = args.layers * args.topk
    # The host side is timed on a shard of ~1,000 fragments (2M rows, 128 samples).
    host_plan, host_src_rows = make_shard_plan(np.random.default_rng(1), 2**21, 128)
    host = {"fragments": len(host_plan),
            "table_us": host_side_us(host_plan, host_src_rows, width, "uint8"), "goal_us": GOAL_HOST_US}
    print(f"host side of a launch ({len(host_plan)} fragments: validation + fragment table): "
          f"{host['table_us']:.0f} us (goal <= {GOAL_HOST_US:.0f} us per launch)")
    try:
        import torch

        has_cuda = kernels.cuda_available() and torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        msg = "the GPU part needs a CUDA device with torch; none found, only the host side was measured"
        print(msg)
        if args.json:
            print(json.dumps({"bench": "kernel", "host": host, "skipped": msg}))
        return 0

    return _gpu_part(args, torch, host, width, host_plan, host_src_rows)


def _gpu_part(args, torch, host: dict, width: int, host_plan, host_src_rows) -> int:
    """The device half: the kernel against a copy and a naive loop per dtype, and the packed IDs' unpack."""
    from gputq.kernels.cupy_backend import DEFAULT_STEPS, cupy_usable

    host["launch_us"] = _launch_us(torch, host_plan, host_src_rows)
    print(f"host time per widen_scatter call, {len(host_plan)} fragments, CUDA tensors: "
          f"{host['launch_us']:.0f} us")
    rng = np.random.default_rng(0)
    plan, src_rows = make_shard_plan(rng, args.tokens, args.samples)
    dtypes = ["uint8", "uint16", "int32"] if args.dtype == "all" else [args.dtype]
    steps = [int(c) for c in args.steps.split(",") if c] if cupy_usable() else []
    header = {
        "bench": "kernel",
        "device": torch.cuda.get_device_name(),
        "backend": f"cupy ({DEFAULT_STEPS} 16-byte loads per thread)" if cupy_usable() else "torch fallback",
        "layers": args.layers, "topk": args.topk, "width": width, "tokens": args.tokens,
        "samples": args.samples, "fragments": len(plan), "iters": args.iters, "sets": SETS,
        "out_gib": args.tokens * width * 4 / 2**30, "host": host,
    }
    print(f"widen+scatter on {header['device']} via {header['backend']}: {args.tokens} rows x "
          f"W={width} ({header['out_gib']:.2f} GiB int32 out), {len(plan)} fragments, "
          f"{args.samples} samples; median of {args.iters} after warm-up, {SETS} input sets")
    print(f"{'dtype':7} {'kernel GB/s':>11} {'copy GB/s':>10} {'naive GB/s':>10} "
          f"{'vs copy':>8} {'vs naive':>9} {'host us':>8} match")
    results = {}
    for dtype in dtypes:
        r = bench_dtype(torch, dtype, plan, src_rows, width, args.iters, steps)
        results[dtype] = r
        print(f"{dtype:7} {r['kernel_gbps']:11.0f} {r['copy_gbps']:10.0f} {r['naive_gbps']:10.0f} "
              f"{r['ratio_vs_copy']:8.2f} {r['speedup_vs_naive']:8.1f}x {r['host_us_per_call']:8.0f} "
              f"{r['matches_naive']}")
        for k, g in r["steps_gbps"].items():
            print(f"        steps {k}: {g:.0f} GB/s")
    packed = None
    if args.experts and cupy_usable():
        packed = bench_packed(torch, plan, src_rows, args.layers, args.topk, args.experts, args.iters)
        print(f"unpack (E={args.experts}, {packed['bits']} bits, {packed['row_bytes']} bytes a row): "
              f"{packed['kernel_out_gbps']:.0f} GB/s out, {packed['ratio_vs_copy']:.2f}x a copy of its output "
              f"({packed['copy_out_gbps']:.0f}); matches the host codec: {packed['matches_reference']}")
    print(f"goals: kernel/copy >= {GOAL_VS_COPY}, kernel/naive >= {GOAL_VS_NAIVE}x, "
          f"host <= {GOAL_HOST_US:.0f} us per launch; unpack >= {GOAL_VS_COPY}x a copy of its output")
    if args.json:
        print(json.dumps({**header, "goal_vs_copy": GOAL_VS_COPY, "goal_vs_naive": GOAL_VS_NAIVE,
                          "results": results, "packed": packed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
