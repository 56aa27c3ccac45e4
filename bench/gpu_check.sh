#!/usr/bin/env bash
# Every GPU check in one call, for a short GPU lease:
#   1. the GPU tests (kernel vs numpy reference bit for bit, pinned arenas, tcp
#      staging into CUDA memory, full shard restore into GPU over tcp and rdma);
#   2. the kernel benchmark (widen+scatter vs device copy vs naive torch);
#   3. a shard fetched and restored into GPU memory over tcp and over rdma (same host);
# then a short table last. Logs and JSON land in $OUT (default out/gpu_check).
#
# Needs: python3 with numpy, torch (CUDA), cupy, msgpack, pytest. Wheels in .whl/
# (e.g. nixl-cu13 for this Python) are installed into a private folder first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gputq-site .whl/*.whl && export PYTHONPATH=/tmp/gputq-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
date -u +"%Y-%m-%dT%H:%M:%SZ" > "$OUT/date"
nvidia-smi -L | tee "$OUT/gpu"

step() { echo; echo "=== $1"; }

step "GPU tests"
timeout 150 $PY -m pytest -q -p no:cacheprovider -m "gpu or rdma" tests/kernels tests/transport \
    tests/test_storage_unit.py tests/test_gpu_restore.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15

step "kernel benchmark"
timeout 60 $PY -m bench.kernel --json 2>&1 | tee "$OUT/kernel.log" | tail -8

for transport in tcp rdma; do
  step "shard fetch into GPU over $transport"
  timeout 60 $PY -m bench.fetch --device cuda --transport "$transport" --sizes 64,256 --repeats 3 --json \
      2>&1 | tee "$OUT/fetch_$transport.log" | tail -6
done

step "summary"
$PY - "$OUT" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
def last_json(name):
    try:
        lines = (out / name).read_text().strip().splitlines()
        return json.loads(lines[-1])
    except Exception as exc:
        return {"error": f"{name}: {exc}"}
rows = []
log = (out / "pytest_gpu.log").read_text() if (out / "pytest_gpu.log").exists() else ""
summary = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed)", l)]
rows.append(("GPU tests", summary[-1].strip("= ") if summary else "no result"))
kernel = last_json("kernel.log")
for dtype, r in kernel.get("results", {}).items():
    rows.append((f"kernel {dtype}", f"{r['kernel_gbps']:.0f} GB/s, {r['ratio_vs_copy']:.2f}x copy "
                 f"({r['copy_gbps']:.0f}), {r['speedup_vs_naive']:.1f}x naive ({r['naive_gbps']:.0f})"))
if "error" in kernel:
    rows.append(("kernel", kernel["error"]))
for transport in ("tcp", "rdma"):
    fetch = last_json(f"fetch_{transport}.log")
    for r in fetch.get("rows", []):
        rows.append((f"fetch->GPU {transport} {r['shard_MiB']} MiB",
                     f"{r['fetch_GBps']} GB/s fetch, {r['fetch+restore_GBps']} GB/s with restore, "
                     f"{r['ratio_vs_socket']}x socket ({r['socket_GBps']})"))
    if "error" in fetch:
        rows.append((f"fetch {transport}", fetch["error"]))
width = max(len(k) for k, _ in rows)
print(f"gputq GPU check {(out / 'date').read_text().strip()} on {(out / 'gpu').read_text().strip()}")
for k, v in rows:
    print(f"{k:<{width}}  {v}")
PY
