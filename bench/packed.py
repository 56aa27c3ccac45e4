"""Packed expert IDs on the host: packing against one pass over the step, unpacking against a uint16 widen.

``python -m bench.packed [--tokens 8192] [--layers 48] [--repeats 9] [--json]``

For each (E, K) of ``--shapes`` (default 128/8, 256/8, 384/8, 512/10, the
experts and top-k of today's MoE models) one step of ``[T, L, K]`` int32
IDs below E is timed, interleaved, in one run:

- **pack**: what ``Writer.put`` runs, :func:`gputq.data.fields.canonicalize`
  of a packed spec into layer-major bytes (checks every ID, packs at
  ``ceil(log2 E)`` bits: the host codec, ``kernels/host_pack.c``, where it
  builds), against **the pass**: ``bench.put``'s chunked pass that narrows
  the same IDs to uint16 and checks their range, the strongest plain-numpy
  baseline of what a writer must do anyway;
- **unpack**: :func:`gputq.kernels.host_native.unpack_rows_host` of the
  packed rows into int32 (the codec the host restores use), against **the
  widen**: the same int32 output widened from uint16 rows, what a host
  restore of uint16 IDs does;
- for reference, the codec an ID at a time (``bytewise_``: its vector
  paths off, as on CPUs without fast BMI2), and numpy's own codec (:func:`~gputq.data.packing.pack_rows`,
  :func:`~gputq.kernels.reference.unpack_rows_into`), which runs where no C
  compiler is.

Medians of ``--repeats`` (after one warm-up), GB/s per int32 byte (the
input of pack, the output of unpack), and the ratios the issue's goals are
stated in: pack over the pass (goal <= 1.5) and unpack throughput over the
widen's (goal >= 0.8). Stored bytes per row and layer are exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from bench.common import add_json_flag, emit_json, print_header, print_table
from bench.put import one_pass
from gputq.data.canonical import canonicalize
from gputq.data.fields import routed_experts_spec
from gputq.data.packing import bits_for, pack_rows
from gputq.kernels.host_native import host_codec, host_codec_status, unpack_rows_host
from gputq.kernels.plan import packed_row_bytes
from gputq.kernels.reference import unpack_rows_into

__all__ = ["measure", "main"]

DEFAULT_SHAPES = ((128, 8), (256, 8), (384, 8), (512, 10))


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _bytewise(fn, repeats: int) -> float:
    """:func:`_median_s` of ``fn`` with the codec's vector paths off (an ID at a time), where the codec loads."""
    lib = host_codec()
    if lib is None:
        return float("nan")
    paths = lib.gputq_set_paths(-1)
    lib.gputq_set_paths(0)
    try:
        return _median_s(fn, repeats)
    finally:
        lib.gputq_set_paths(paths)


def measure(experts: int, topk: int, tokens: int, layers: int, repeats: int) -> dict:
    """One (E, K) row: exact stored bytes, and pack/pass and unpack/widen medians, timed interleaved."""
    ids = np.random.default_rng(experts).integers(0, experts, (tokens, layers, topk)).astype(np.int32)
    bits = bits_for(experts)
    row_bytes = packed_row_bytes(topk, bits)
    packed_out = np.empty(tokens * layers * row_bytes, np.uint8)
    packed = pack_rows(ids, experts)
    rows = packed.reshape(-1, row_bytes)
    narrow = ids.astype(np.uint16).reshape(-1, topk)
    restored = np.empty((tokens * layers, topk), np.int32)
    the_pass = one_pass("uint16", {"routed_experts": ids}, experts=experts)
    spec = routed_experts_spec(layers, topk, "packed", experts)
    put_pack = lambda: canonicalize("bench", spec, ids, out=packed_out, layer_major=True)  # noqa: E731
    times: dict[str, list] = {"pack": [], "pass": [], "unpack": [], "widen": [], "numpy_pack": [], "numpy_unpack": [],
                              "bytewise_pack": [], "bytewise_unpack": []}
    unpack = lambda: unpack_rows_host(rows, topk, bits, restored)  # noqa: E731
    for _ in range(3):  # alternate, so that drift on a shared host hits both sides
        times["pack"].append(_median_s(put_pack, repeats))
        times["pass"].append(_median_s(the_pass, repeats))
        times["numpy_pack"].append(_median_s(lambda: pack_rows(ids, experts, out=packed_out), repeats))
        times["unpack"].append(_median_s(unpack, repeats))
        times["widen"].append(_median_s(lambda: np.copyto(restored, narrow, casting="unsafe"), repeats))
        times["numpy_unpack"].append(_median_s(lambda: unpack_rows_into(rows, topk, bits, restored), repeats))
        times["bytewise_pack"].append(_bytewise(put_pack, repeats))
        times["bytewise_unpack"].append(_bytewise(unpack, repeats))
    med = {k: statistics.median(v) for k, v in times.items()}
    assert np.array_equal(restored, ids.reshape(-1, topk))
    assert np.array_equal(put_pack().transpose(1, 0, 2), packed)
    gbps = {k: ids.nbytes / s / 1e9 for k, s in med.items()}
    return {"experts": experts, "topk": topk, "bits": bits, "row_bytes": row_bytes, "uint8_row_bytes": topk,
            "uint16_row_bytes": 2 * topk, **{f"{k}_gbps": v for k, v in gbps.items()},
            "pack_vs_pass": med["pack"] / med["pass"], "unpack_vs_widen": med["widen"] / med["unpack"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.packed", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the step")
    parser.add_argument("--layers", type=int, default=48, help="recorded MoE layers L")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per median")
    parser.add_argument("--shapes", type=lambda s: [tuple(map(int, p.split("/"))) for p in s.split(",")],
                        default=list(DEFAULT_SHAPES), help="E/K pairs, e.g. 384/8,512/10")
    args = add_json_flag(parser).parse_args(argv)
    if min(args.tokens, args.layers, args.repeats) < 1:
        parser.error("--tokens, --layers and --repeats must be >= 1")
    rows = [measure(e, k, args.tokens, args.layers, args.repeats) for e, k in args.shapes]
    if args.json:
        emit_json({"bench": "packed", "tokens": args.tokens, "layers": args.layers, "host_codec": host_codec_status(),
                   "rows": rows})
        return 0
    print_header("packed expert IDs on the host", tokens=args.tokens, layers=args.layers, repeats=args.repeats,
                 cpus=os.cpu_count(), host_codec=host_codec_status())
    print_table(rows, ["experts", "topk", "bits", "row_bytes", "uint16_row_bytes", "pack_gbps", "pass_gbps",
                       "pack_vs_pass", "unpack_gbps", "widen_gbps", "unpack_vs_widen", "bytewise_pack_gbps",
                       "bytewise_unpack_gbps", "numpy_pack_gbps", "numpy_unpack_gbps"])
    print("GB/s per int32 byte (pack's input, unpack's output); goals: pack_vs_pass <= 1.5, unpack_vs_widen >= 0.8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
