#!/usr/bin/env bash
# Every GPU check in one call, for a short GPU lease: the step timeouts add up to under 5 minutes
# (100 + 20 + 50 + 3 x 40 s) on one H200 with 16 cores:
#   1. the GPU tests (kernel vs numpy reference bit for bit, zero-copy from mapped host memory,
#      pinned arenas, tcp staging into CUDA memory, shm reads into CUDA memory, full shard restore
#      into GPU memory over tcp, shm (in place and copied) and rdma);
#   2. the machine's anchors: pinned host-to-GPU copy, device copy, host memcpy, plain socket;
#   3. the kernel benchmark (widen+scatter vs device copy vs naive torch, host time per launch);
#   4. a shard fetched and restored into GPU memory over shm (copied first, and in place), rdma and tcp;
# then a short table last, every fetch with its ratio to the pinned copy of the same run.
# Logs and JSON land in $OUT (default out/gpu_check).
#
# Needs: python3 with numpy, torch (CUDA), cupy, msgpack, pytest; no internet. Wheels in .whl/
# (or $WHEELS; e.g. nixl-cu13 and nixl for this Python) are installed into a private folder first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gputq-site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/gputq-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
date -u +"%Y-%m-%dT%H:%M:%SZ" > "$OUT/date"
nvidia-smi -L | tee "$OUT/gpu"

step() { echo; echo "=== $1"; }

step "GPU tests"
timeout 100 $PY -m pytest -q -p no:cacheprovider -m "gpu or rdma" tests/kernels tests/transport \
    tests/test_storage_unit.py tests/test_gpu_restore.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15

step "anchors"
timeout 20 $PY -m bench.anchors --mib 256 --json 2>&1 | tee "$OUT/anchors.log" | tail -7

step "kernel benchmark"
# 2 groups per thread as well: the uint8 kernel then fits 32 registers (8 blocks per SM, not 6)
timeout 50 $PY -m bench.kernel --json --steps "${KERNEL_STEPS:-2,4}" 2>&1 \
    | tee "$OUT/kernel.log" | tail -9

# over shm one run times both paths: copied in spans first, and read in place (zero-copy)
for transport in shm rdma tcp; do
  step "shard fetch+restore into GPU over $transport"
  timeout 40 $PY -m bench.fetch --device cuda --transport "$transport" \
      --sizes 64,256 --repeats 3 --json 2>&1 | tee "$OUT/fetch_$transport.log" | tail -7
done

step "summary"
$PY - "$OUT" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
def last_json(name):
    try:
        return json.loads((out / name).read_text().strip().splitlines()[-1])
    except Exception as exc:
        return {"error": f"{name}: {exc}"}
rows = []
log = (out / "pytest_gpu.log").read_text() if (out / "pytest_gpu.log").exists() else ""
summary = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed)", l)]
rows.append(("GPU tests", summary[-1].strip("= ") if summary else "no result"))
anchors = last_json("anchors.log")
pinned = anchors.get("pinned_h2d")
for name in ("pinned_h2d", "device_copy", "host_memcpy", "socket"):
    if name in anchors:
        rows.append((f"anchor {name}", f"{anchors[name]:.1f} GB/s"))
if "error" in anchors or "gpu_skipped" in anchors:
    rows.append(("anchors", anchors.get("error") or anchors["gpu_skipped"]))
kernel = last_json("kernel.log")
for dtype, r in kernel.get("results", {}).items():
    rows.append((f"kernel {dtype}", f"{r['kernel_gbps']:.0f} GB/s, {r['ratio_vs_copy']:.2f}x copy "
                 f"({r['copy_gbps']:.0f}), {r['speedup_vs_naive']:.1f}x naive ({r['naive_gbps']:.0f})"))
    for steps, gbps in r.get("steps_gbps", {}).items():
        rows.append((f"kernel {dtype}, {steps} groups/thread", f"{gbps:.0f} GB/s, {gbps / r['copy_gbps']:.2f}x copy"))
host = kernel.get("host", {})
if host:
    call = f", whole call {host['launch_us']:.0f} us" if "launch_us" in host else ""
    rows.append((f"kernel host side, {host.get('fragments')} frags", f"table {host.get('table_us', 0):.0f} us{call}"))
if "error" in kernel:
    rows.append(("kernel", kernel["error"]))
for name in ("shm", "rdma", "tcp"):
    fetch = last_json(f"fetch_{name}.log")
    for r in fetch.get("rows", []):
        total = r["fetch+restore_GBps"]
        ratio = f", {total / pinned:.2f}x pinned" if pinned else ""
        # in place the bytes move in the restore itself: there is no transfer to time apart
        alone = "" if r["fetch_GBps"] is None else f" (fetch alone {r['fetch_GBps']} GB/s)"
        path = f" {r['path']}" if name == "shm" else ""
        rows.append((f"fetch+restore->GPU {name}{path} {r['shard_MiB']} MiB", f"{total} GB/s{ratio}{alone}"))
    if "error" in fetch:
        rows.append((f"fetch {name}", fetch["error"]))
    if name == "shm" and "reads over" in (out / f"fetch_{name}.log").read_text():
        rows.append((f"fetch {name}", "WARNING: the shm channel fell back (see the log): not an shm figure"))
width = max(len(k) for k, _ in rows)
print(f"gputq GPU check {(out / 'date').read_text().strip()} on {(out / 'gpu').read_text().strip()}")
print(f"goals: shm fetch+restore >= 0.8x pinned copy; kernel >= 0.9x device copy; host <= 50 us")
for k, v in rows:
    print(f"{k:<{width}}  {v}")
PY
