"""What the machine itself moves: the anchors every gputq figure is compared with.

``python -m bench.anchors [--mib 256] [--repeats 5] [--json]``

Measured in one run, on the same buffers size:

- ``host_memcpy``: one thread copying host memory (``numpy.copyto``);
- ``socket``: a plain loopback socket (:class:`bench.common.SocketBaseline`);
- ``pinned_h2d``: a page-locked host buffer copied to the GPU (``cudaMemcpy``);
- ``device_copy``: a device-to-device copy (GB/s of bytes copied, not read + written).

The GPU anchors need torch with CUDA and are left out (with the reason)
without one. GB/s are 10**9 bytes per second, medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from bench.common import SocketBaseline, add_json_flag, emit_json, gbps, median_time, print_header, print_table

__all__ = ["measure", "main"]

_MIB = 1 << 20


def measure(nbytes: int, repeats: int = 5) -> dict:
    """The anchors for ``nbytes``, as ``{name: GB/s}`` (GPU ones absent without CUDA, with ``gpu_skipped``)."""
    src, dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
    result = {"host_memcpy": gbps(nbytes, median_time(lambda: np.copyto(dst, src), repeats))}
    with SocketBaseline(nbytes) as baseline:
        baseline.read(nbytes)
        result["socket"] = gbps(nbytes, statistics.median(baseline.read(nbytes) for _ in range(repeats)))
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        result["gpu_skipped"] = "no CUDA device through torch"
        return result
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e-3)
        return statistics.median(times)

    result["pinned_h2d"] = gbps(nbytes, timed(lambda: a.copy_(host, non_blocking=True)))
    result["device_copy"] = gbps(nbytes, timed(lambda: b.copy_(a)))
    result["device"] = torch.cuda.get_device_name()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.anchors", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per measurement, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    print_header("machine anchors", MiB=args.mib, repeats=args.repeats)
    result = measure(args.mib * _MIB, args.repeats)
    rows = [{"anchor": k, "GBps": round(v, 2)} for k, v in result.items() if isinstance(v, float)]
    print_table(rows, ["anchor", "GBps"])
    if "gpu_skipped" in result:
        print(f"GPU anchors skipped: {result['gpu_skipped']}")
    if args.json:
        emit_json({"bench": "anchors", "MiB": args.mib, **result})


if __name__ == "__main__":
    main()
