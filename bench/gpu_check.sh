#!/usr/bin/env bash
# Every GPU check in one call, for a short GPU lease: the step timeouts add up to about 8 minutes
# (100 + 20 + 70 + 3 x 40 + 45 + 2 x 60 s) on one H200 with 16 cores:
#   1. the GPU tests (kernel vs numpy reference bit for bit, zero-copy from mapped host memory,
#      pinned arenas, tcp staging into CUDA memory, shm reads into CUDA memory, full shard restore
#      into GPU memory over tcp, shm (in place and copied) and rdma);
#   2. the machine's anchors: pinned host-to-GPU copy, device copy, host memcpy, plain socket;
#   3. the kernel benchmark (widen+scatter vs device copy vs naive torch, host time per launch; the
#      unpack kernel of packed IDs vs a device copy of its output);
#   4. a shard fetched and restored into GPU memory over shm (copied first, and in place), rdma and tcp;
#   5. rdma reads against raw NIXL and tcp against a plain socket (bench.transport), on this machine's
#      cores: one read, and reads leased ahead as a stream leases them;
#   6. the trainer stream restored on the host over shm and tcp against its ceiling of the same run (the
#      same bytes through memory or a bare socket plus numpy's widen), on this machine's cores: where the
#      units, the fetch thread and the restore thread do not share two cores as on a small dev box;
# then a short table last, every fetch with its ratio to the pinned copy of the same run.
# Logs and JSON land in $OUT (default out/gpu_check). Without a GPU every step still runs (rehearse it
# before a lease: PYTHON=.venv/bin/python bash bench/gpu_check.sh); one that needs CUDA shows its error
# in the table.
#
# Needs: python3 >= 3.11 with numpy, torch (CUDA), cupy, msgpack, pyyaml, pytest, pytest-timeout;
# no internet, and gputq need not be installed (it is laid out from the checkout, below). Wheels
# in .whl/ (or $WHEELS; e.g. nixl-cu13 and nixl for this Python) are installed into a private
# folder first.
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
# gputq is not installed here: lay it out as it installs (setup.py's package_dir puts transport/
# and kernels/ inside it, as gputq.transport and gputq.kernels) in a temporary folder, first on
# PYTHONPATH; $PWD stays on it for bench and tests. The checkout's own ./gputq (which has neither)
# must not shadow the layout: PYTHONSAFEPATH=1 (Python >= 3.11) keeps the current folder and the
# script's off sys.path, in subprocesses too, and pytest runs with --import-mode=append (it would
# otherwise put the rootdir first).
if ! $PY -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "gpu_check.sh needs Python >= 3.11 (PYTHONSAFEPATH); $PY is $($PY -V 2>&1)" >&2
  exit 2
fi
LAYOUT=$(mktemp -d "${TMPDIR:-/tmp}/gputq-layout.XXXXXX")
trap 'rm -rf "$LAYOUT"' EXIT
cp -R gputq "$LAYOUT/gputq" && cp -R transport "$LAYOUT/gputq/transport" && cp -R kernels "$LAYOUT/gputq/kernels" \
  || { echo "gpu_check.sh: could not lay gputq out in $LAYOUT" >&2; exit 2; }
find "$LAYOUT" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONPATH=$LAYOUT:$PWD:${PYTHONPATH:-} PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
date -u +"%Y-%m-%dT%H:%M:%SZ" > "$OUT/date"
$PY -c 'import gputq.transport as t, gputq.kernels as k; print("gputq from", t.__file__, k.__file__)' \
    | tee "$OUT/layout"
nvidia-smi -L | tee "$OUT/gpu"

step() { echo; echo "=== $1"; }

step "GPU tests"
GPU_TESTS="tests/kernels tests/transport tests/unit/test_storage_unit.py tests/client/test_gpu_restore.py"
# Without hypothesis (no GPU needs it) the modules that import it, which hold no gpu or rdma test,
# are left out instead of stopping the collection.
NO_HYPOTHESIS=""
if ! $PY -c 'import hypothesis' 2>/dev/null; then
  for f in $(grep -rlE '^(from|import) hypothesis' $GPU_TESTS); do NO_HYPOTHESIS+=" --ignore=$f"; done
fi
timeout 100 $PY -m pytest -q -p no:cacheprovider --import-mode=append $NO_HYPOTHESIS -m "gpu or rdma" $GPU_TESTS \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -15

step "anchors"
timeout 20 $PY -m bench.anchors --mib 256 --json 2>&1 | tee "$OUT/anchors.log" | tail -7

step "kernel benchmark"
# 2 groups per thread as well: the uint8 kernel then fits 32 registers (8 blocks per SM, not 6)
timeout 70 $PY -m bench.kernel --json --steps "${KERNEL_STEPS:-2,4}" 2>&1 \
    | tee "$OUT/kernel.log" | tail -9

# over shm one run times both paths: copied in spans first, and read in place (zero-copy)
for transport in shm rdma tcp; do
  step "shard fetch+restore into GPU over $transport"
  timeout 40 $PY -m bench.fetch --device cuda --transport "$transport" \
      --sizes 64,256 --repeats 3 --json 2>&1 | tee "$OUT/fetch_$transport.log" | tail -7
done

step "rdma reads vs raw NIXL, tcp vs socket, on $(nproc) cores"
timeout 45 $PY -m bench.transport --repeats 3 --json 2>&1 | tee "$OUT/transport.log" | tail -3

for transport in shm tcp; do
  step "trainer stream, host restore, over $transport on $(nproc) cores"
  timeout 60 $PY -m bench.trainer --transport "$transport" --figures '' --scales 4 --repeats 5 \
      --overlap-steps 3 --json 2>&1 | tee "$OUT/trainer_$transport.log" | tail -3
done

step "summary"
$PY -m bench.gpu_summary "$OUT"
