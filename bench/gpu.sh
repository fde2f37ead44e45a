#!/usr/bin/env bash
# GPU checks and kernel benchmark, in one prepared run, for a machine with a CUDA device.
#
#   bench/gpu.sh [--quick]        (from anywhere; needs `make setup` done: .venv with torch and triton)
#
# 1. the full ahead-of-time compile sweep (python -m kernels.triton_aot: every variant for sm_80 and sm_90,
#    no GPU needed, over all cores): bench/results/triton_aot.json;
# 2. the GPU kernel tests: every test under tests/kernels on the device (the Triton tests compile for the
#    local GPU and compare against the torch twins; the gpu-marked ones at realistic sizes), except the
#    default-tier compile sweep, which step 1 covers; and the CUDA-graph decode check
#    (tests/engine/test_decode_graphs.py: captured buckets give the eager path's tokens);
# 3. bench.gpu_kernels: Triton paged attention and LoRA vs the torch twins, a table on stdout and
#    bench/results/gpu_kernels.json.
# Results land in bench/results/ (triton_aot.{json,log}, gpu_tests.{xml,log}, gpu_kernels.{json,log},
# gpu_env.txt). Exit status: 0 when every step passes, else the first failure's (later steps still run,
# so one run gives everything). Each step has a timeout (GPU_AOT_TIMEOUT, GPU_TEST_TIMEOUT,
# GPU_BENCH_TIMEOUT seconds) and every Triton cache is a fresh temporary directory, removed at exit.
set -euo pipefail

QUICK=""
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK="--quick" ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
RESULTS="$ROOT/bench/results"
AOT_TIMEOUT="${GPU_AOT_TIMEOUT:-900}"
TEST_TIMEOUT="${GPU_TEST_TIMEOUT:-1500}"
BENCH_TIMEOUT="${GPU_BENCH_TIMEOUT:-900}"

if [[ ! -x "$PY" ]]; then
  echo "no Python at $PY: run 'make setup' first (or set PYTHON)" >&2
  exit 2
fi
command -v timeout >/dev/null || { echo "needs coreutils timeout" >&2; exit 2; }
mkdir -p "$RESULTS"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "torch sees no CUDA device: bench/gpu.sh is for a GPU machine" >&2
  exit 3
fi

TRITON_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/loraplex-triton.XXXXXX")"
export TRITON_CACHE_DIR
trap 'rm -rf "$TRITON_CACHE_DIR"' EXIT
unset TRITON_INTERPRET  # compiled kernels on the device, never the interpreter
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi: not available"
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())' \
    || echo "torch/triton device info: not available"
} 2>&1 | tee "$RESULTS/gpu_env.txt"

status=0
echo "== 1/3 ahead-of-time compile sweep, sm_80 and sm_90 (timeout ${AOT_TIMEOUT}s)"
set +e
# kernels.triton_aot makes its own fresh cache when TRITON_CACHE_DIR is unset
env -u TRITON_CACHE_DIR timeout --kill-after=30 "$AOT_TIMEOUT" "$PY" -m kernels.triton_aot --jobs "$(nproc)" \
  --tier full --quiet --json "$RESULTS/triton_aot.json" 2>&1 | tee "$RESULTS/triton_aot.log"
aot_status=${PIPESTATUS[0]}
set -e
if [[ $aot_status -ne 0 ]]; then
  echo "compile sweep failed (exit $aot_status; 124 = timed out): see $RESULTS/triton_aot.log" >&2
  status=$aot_status
fi

echo "== 2/3 GPU kernel tests (timeout ${TEST_TIMEOUT}s)"
set +e
timeout --kill-after=30 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_decode_graphs.py \
  -k "not every_dispatchable_variant" --junitxml="$RESULTS/gpu_tests.xml" -o timeout=600 \
  2>&1 | tee "$RESULTS/gpu_tests.log"
test_status=${PIPESTATUS[0]}
set -e
if [[ $test_status -ne 0 ]]; then
  echo "GPU kernel tests failed (exit $test_status; 124 = timed out): see $RESULTS/gpu_tests.log" >&2
  [[ $status -ne 0 ]] || status=$test_status
fi

echo "== 3/3 GPU kernel benchmark (timeout ${BENCH_TIMEOUT}s)"
set +e
timeout --kill-after=30 "$BENCH_TIMEOUT" "$PY" -m bench.gpu_kernels $QUICK 2>&1 | tee "$RESULTS/gpu_kernels.log"
bench_status=${PIPESTATUS[0]}
set -e
if [[ $bench_status -ne 0 ]]; then
  echo "GPU kernel benchmark failed (exit $bench_status; 124 = timed out): see $RESULTS/gpu_kernels.log" >&2
  [[ $status -ne 0 ]] || status=$bench_status
fi

echo "== done: compile sweep exit $aot_status, tests exit $test_status, benchmark exit $bench_status; results in $RESULTS"
exit "$status"
