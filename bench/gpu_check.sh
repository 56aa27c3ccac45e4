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
$PY -m bench.gpu_summary "$OUT"
