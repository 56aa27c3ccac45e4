"""The table that ends ``bench/gpu_check.sh``: one line per check, every fetch against the pinned copy,
rdma reads against raw NIXL, the host-restored trainer stream against its ceiling.

``python -m bench.gpu_summary OUT``

Reads what the script's steps left in ``OUT``: ``date`` and ``gpu``, the
GPU tests' log, and the last JSON line of ``anchors.log``, ``kernel.log``,
``fetch_{shm,rdma,tcp}.log``, ``transport.log`` and ``trainer_{shm,tcp}.log``. A step that
failed, timed out or was skipped (no GPU) is a line saying so, never a
missing table: the GPU lease that ran the script may not come back.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

__all__ = ["GOALS", "summary_rows", "main"]

GOALS = ("goals: shm fetch+restore >= 0.8x pinned copy; kernel >= 0.9x device copy; host <= 50 us; "
         "rdma reads leased ahead >= 0.9x raw NIXL; trainer stream >= 0.8x its ceiling, overlap <= 1.05")
_FETCH_TRANSPORTS = ("shm", "rdma", "tcp")
_TRAINER_TRANSPORTS = ("shm", "tcp")


def _last_json(out: Path, name: str) -> dict:
    """The log's last line as JSON, or ``{"error": ...}`` saying why not: no log (the step never ran), an
    empty one (killed by its timeout before a line), or the line it ended on (a step that raised: its error)."""
    path = out / name
    if not path.exists():
        return {"error": f"{name}: missing (the step did not run)"}
    lines = path.read_text(errors="replace").strip().splitlines()
    if not lines:
        return {"error": f"{name}: empty (killed by its timeout before it wrote a line?)"}
    try:
        return json.loads(lines[-1])
    except ValueError:
        return {"error": f"{name} ends without its JSON line: {lines[-1].strip()[:300]}"}


def _read(out: Path, name: str) -> str:
    path = out / name
    return path.read_text() if path.exists() else ""


def _kernel_rows(kernel: dict) -> list[tuple[str, str]]:
    rows = []
    for dtype, r in kernel.get("results", {}).items():
        match = "" if r.get("matches_naive", True) else ", WRONG BYTES (differs from naive torch)"
        rows.append((f"kernel {dtype}", f"{r['kernel_gbps']:.0f} GB/s, {r['ratio_vs_copy']:.2f}x copy "
                     f"({r['copy_gbps']:.0f}), {r['speedup_vs_naive']:.1f}x naive ({r['naive_gbps']:.0f}){match}"))
        for steps, gbps in r.get("steps_gbps", {}).items():
            rows.append((f"kernel {dtype}, {steps} groups/thread",
                         f"{gbps:.0f} GB/s, {gbps / r['copy_gbps']:.2f}x copy"))
    packed = kernel.get("packed")
    if packed:
        match = "" if packed["matches_reference"] else ", WRONG BYTES (differs from the host codec)"
        rows.append((f"unpack E={packed['experts']} ({packed['bits']} bits)",
                     f"{packed['kernel_out_gbps']:.0f} GB/s out, {packed['ratio_vs_copy']:.2f}x a copy of its "
                     f"output ({packed['copy_out_gbps']:.0f}){match}"))
    host = kernel.get("host", {})
    if host:
        call = f", whole call {host['launch_us']:.0f} us" if "launch_us" in host else ""
        rows.append((f"kernel host side, {host.get('fragments')} frags",
                     f"table {host.get('table_us', 0):.0f} us{call}"))
    for problem in ("error", "skipped"):
        if problem in kernel:
            rows.append(("kernel", kernel[problem]))
    return rows


def _fetch_rows(out: Path, name: str, pinned: float | None) -> list[tuple[str, str]]:
    fetch, rows = _last_json(out, f"fetch_{name}.log"), []
    for r in fetch.get("rows", []):
        total = r["fetch+restore_GBps"]
        ratio = f", {total / pinned:.2f}x pinned" if pinned else ""
        # in place the bytes move in the restore itself: there is no transfer to time apart
        alone = "" if r["fetch_GBps"] is None else f" (fetch alone {r['fetch_GBps']} GB/s)"
        path = f" {r['path']}"
        rows.append((f"fetch+restore->GPU {name}{path} {r['shard_MiB']} MiB",
                     f"{total} GB/s{ratio}{alone}"))
    if "error" in fetch:
        rows.append((f"fetch {name}", fetch["error"]))
    if name == "shm" and "reads over" in _read(out, f"fetch_{name}.log"):
        rows.append((f"fetch {name}", "WARNING: the shm channel fell back (see the log): not an shm figure"))
    return rows


def _transport_rows(out: Path) -> list[tuple[str, str]]:
    """``bench.transport`` on this machine's cores: per shape, rdma against raw NIXL (one read; reads leased
    ahead as a stream leases them, the first lease's round trip counted and not) and tcp against a socket."""
    transport = _last_json(out, "transport.log")
    if "error" in transport:
        return [("transport", transport["error"])]
    return [(f"rdma vs raw NIXL {r['shape']} ({r['MiB']:g} MiB)",
             f"one read {r['rdma/nixl']:.2f}x, reads leased ahead {r['rdma ahead/nixl']:.2f}x, "
             f"once the first lease is answered {r['rdma steady/nixl']:.2f}x ({r['nixl GB/s']:.2f} GB/s); "
             f"tcp {r['tcp/socket']:.2f}x socket") for r in transport.get("rows", [])]


def _trainer_rows(out: Path, name: str) -> list[tuple[str, str]]:
    """The host-restored trainer stream of ``bench.trainer`` on this machine's cores, slice by slice."""
    trainer = _last_json(out, f"trainer_{name}.log")
    if "error" in trainer:
        return [(f"trainer {name}", trainer["error"])]
    rows = []
    for r in trainer.get("throughput_rows", []):
        one, alone = r.get("one_thread_widen_vs_ceiling"), r.get("restores_vs_ceiling")
        widen = "" if one is None else f", one widening thread {one:.2f}x"
        widen += "" if alone is None else f", its restores alone {alone:.2f}x"
        rows.append((f"trainer stream {name} {r['slice_MiB']:g} MiB",
                     f"{r['stream_vs_ceiling']:.2f}x its ceiling ({r['ceiling']}, {r['ceiling_GBps']} GB/s), "
                     f"later half {r['second_half_vs_ceiling']:.2f}x{widen}"))
    rows.append((f"trainer overlap {name}", f"{trainer['overlap_ratio']:.3f}, after the first micro-batch "
                                            f"{trainer['overlap_ratio_after_first']:.3f}"))
    return rows


def summary_rows(out: Path) -> list[tuple[str, str]]:
    """``(check, result)`` lines from the outputs of ``bench/gpu_check.sh`` in ``out``."""
    out = Path(out)
    summary = [line for line in _read(out, "pytest_gpu.log").splitlines() if re.search(r"\d+ (passed|failed)", line)]
    rows = [("GPU tests", summary[-1].strip("= ") if summary else "no result")]
    anchors = _last_json(out, "anchors.log")
    pinned = anchors.get("pinned_h2d")
    for name in ("pinned_h2d", "device_copy", "host_memcpy", "socket"):
        if name in anchors:
            rows.append((f"anchor {name}", f"{anchors[name]:.1f} GB/s"))
    if "error" in anchors or "gpu_skipped" in anchors:
        rows.append(("anchors", anchors.get("error") or anchors["gpu_skipped"]))
    rows += _kernel_rows(_last_json(out, "kernel.log"))
    for name in _FETCH_TRANSPORTS:
        rows += _fetch_rows(out, name, pinned)
    rows += _transport_rows(out)
    for name in _TRAINER_TRANSPORTS:
        rows += _trainer_rows(out, name)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_summary", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder bench/gpu_check.sh wrote (its $OUT)")
    out = parser.parse_args(argv).out
    rows = summary_rows(out)
    width = max(len(check) for check, _ in rows)
    print(f"gputq GPU check {_read(out, 'date').strip() or '(no date)'} on {_read(out, 'gpu').strip() or '(no GPU)'}")
    print(GOALS)
    for check, result in rows:
        print(f"{check:<{width}}  {result}")


if __name__ == "__main__":
    main()
