#!/usr/bin/env bash
# The one prepared run for the GPU box (`make gpu-check`): builds with CUDA
# against this machine's torch, runs every CUDA test (C++ and Python), a
# trainer run with CUDA graphs, and the benchmark suite on the GPU; logs and
# results go to bench/results/ and to $OUT when set, with a summary last.
# Budget: about 8 minutes on one H200 with 16 cores (each stage has a
# timeout, so one that hangs cannot eat the others' time).
#
# On the device tool: carry [".gpu-deps"] (scripts/stage-gpu-deps.sh makes it
# here first: headers, libraries and Fashion-MNIST the box lacks) and run
# `bash scripts/gpu_check.sh`. The CPU-only tests are CI's job, not this one's.
#
# `bash scripts/gpu_check.sh test` stops after the tests and `... bench` skips
# them: two calls on a warm machine (the build in build-gpu/ stays between
# calls, so the second one only relinks) split one long run into two that
# each fit a device call with room to spare.
# $OUT gets 7 logs and this run's results JSON (the device tool returns 8 files):
# gpu_build, gpu_cpp_tests, gpu_py_tests, gpu_bench (headline), gpu_bench_fp8
# (float8 vs bf16, bench/bench_fp8.py, ~30-60 s), gpu_bench_rest, gpu_trainer.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
case "$WHAT" in all | test | bench) ;; *) echo "usage: $0 [all|test|bench]"; exit 2 ;; esac
# Seconds each stage leaves for the stages after it (see cap_for).
case "$WHAT" in
  all) after_build=200 after_cpp=180 after_py=150 ;;
  test) after_build=150 after_cpp=120 after_py=0 ;;
  bench) after_build=150 after_cpp=0 after_py=0 ;;
esac
PY=${PYTHON:-python3}
RESULTS=bench/results
OUTDIR=${OUT:-$RESULTS}
mkdir -p "$RESULTS" "$OUTDIR"
BUILD=build-gpu
status=0
t0=$(date +%s)
# Results files older than this one came with the checkout (CPU runs of the
# same date among them): only those this run writes go to $OUT.
run_marker=$(mktemp)
# The whole run must end inside one device call (600 s at most): each stage
# gets at most its cap and never more than what is left of BUDGET.
BUDGET=${GPU_CHECK_BUDGET:-540}
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*"; }
fail() { echo "!! $*"; status=1; }
# cap_for SECONDS [RESERVE]: min(SECONDS, time left - RESERVE), at least 10.
cap_for() {
  local left=$(( BUDGET - ($(date +%s) - t0) - ${2:-0} ))
  [ "$left" -lt 10 ] && left=10
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

stamp "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'

# The trainer's dataset: where the Debian package puts it, else from .gpu-deps.
FASHION=/usr/share/datasets/fashion-mnist
if [ ! -f "$FASHION/train-images-idx3-ubyte.gz" ] && [ -d .gpu-deps/datasets/fashion-mnist ]; then
  mkdir -p /usr/share/datasets 2>/dev/null && cp -r .gpu-deps/datasets/fashion-mnist /usr/share/datasets/ 2>/dev/null ||
    export FUSETRAIN_FASHION_MNIST="$PWD/.gpu-deps/datasets/fashion-mnist"
fi

stamp "configure + build (CUDA, sm_90)"
prefix="$PWD/.gpu-deps"
export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout "$(cap_for 300 $after_build)" bash -c "cmake -S . -B '$BUILD' -G Ninja -DPython3_EXECUTABLE='$(command -v "$PY")' \
  -DCMAKE_PREFIX_PATH='$prefix' -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_BUILD_TYPE=Release && cmake --build '$BUILD' -j $(nproc)" > "$OUTDIR/gpu_build.log" 2>&1
if [ $? -ne 0 ]; then
  tail -40 "$OUTDIR/gpu_build.log"
  echo "gpu-check: build failed (log: $OUTDIR/gpu_build.log)"
  exit 1
fi
cp -f "$BUILD"/_C.*.so "$BUILD"/libfusetrain.so python/fusetrain/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export FUSETRAIN_BUILD_DIR="$PWD/$BUILD"
"$BUILD"/fusetrain info

if [ "$WHAT" != bench ]; then
stamp "C++ tests"
timeout "$(cap_for 90 $after_cpp)" "$BUILD"/fusetrain_tests > "$OUTDIR/gpu_cpp_tests.log" 2>&1 || fail "C++ tests"
grep -E "FAILED|passed|failed|test cases" "$OUTDIR/gpu_cpp_tests.log" | tail -5

stamp "Python CUDA tests"
# Every test marked @pytest.mark.cuda (tests/python/conftest.py), selected by
# the marker rather than by name; a per-test limit where pytest-timeout is
# installed (the GPU box has it).
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
timeout "$(cap_for 150 $after_py)" "$PY" -m pytest tests/python -q -p no:cacheprovider -m cuda \
  "${per_test[@]}" -rfE > "$OUTDIR/gpu_py_tests.log" 2>&1 ||
  fail "Python tests"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUTDIR/gpu_py_tests.log" | tail -15
fi

if [ "$WHAT" != test ]; then

# The headline modules first (step fusion, end to end, the trainer with
# graphs), then the rest of the suite in what time is left.
stamp "benchmarks (GPU): graph, e2e, trainer"
timeout "$(cap_for 200 60)" "$PY" bench/run.py --device cuda --results-dir "$RESULTS" \
  --only graph --only e2e --only trainer > "$OUTDIR/gpu_bench.log" 2>&1 || fail "benchmarks (headline)"
# Float8 against bf16 (a Linear, the crossover sweep behind
# DEFAULT_FP8_MIN_FEATURES, a 1B-scale GPT block, a small GPT trained 50
# steps): about 30-60 s on an H200.
stamp "benchmarks (GPU): fp8"
timeout "$(cap_for 120 60)" "$PY" bench/run.py --device cuda --results-dir "$RESULTS" \
  --only fp8 > "$OUTDIR/gpu_bench_fp8.log" 2>&1 || fail "benchmarks (fp8)"
stamp "benchmarks (GPU): amp, optim, cross_entropy, ddp"
timeout "$(cap_for 150 30)" "$PY" bench/run.py --device cuda --results-dir "$RESULTS" --quick \
  --only amp --only optim --only cross_entropy --only ddp > "$OUTDIR/gpu_bench_rest.log" 2>&1 ||
  fail "benchmarks (rest)"
find "$RESULTS" -maxdepth 1 -name '*.json' -newer "$run_marker" -exec cp -f {} "$OUTDIR"/ \; 2>/dev/null || true

stamp "trainer on CUDA: Fashion-MNIST CNN, mixed_bfloat16, 16 steps per CUDA graph"
if [ -f "${FUSETRAIN_FASHION_MNIST:-$FASHION}/train-images-idx3-ubyte.gz" ]; then
  timeout "$(cap_for 60)" "$BUILD"/fusetrain train --config configs/fashion_mnist.yaml --device cuda \
    --set runtime.nproc=1 --set "data.path=${FUSETRAIN_FASHION_MNIST:-$FASHION}" \
    --steps-per-execution 16 --run-dir /tmp/fusetrain-gpu-run --set output.progress=lines \
    > "$OUTDIR/gpu_trainer.log" 2>&1 || fail "trainer run"
  grep -E "^epoch|^done|rror" "$OUTDIR/gpu_trainer.log" | tail -8
else
  fail "no Fashion-MNIST files: run scripts/stage-gpu-deps.sh and carry .gpu-deps"
fi

stamp "summary"
tail -45 "$OUTDIR/gpu_bench.log"
# fp8: the crossover and final-loss lines, and the headline rows (notes cut).
grep -E "^fp8 (crossover|gpt:)" "$OUTDIR/gpu_bench_fp8.log"
grep -E "^\| fp8 (linear|GEMM|crossover|GPT block|gpt train,)" "$OUTDIR/gpu_bench_fp8.log" | awk '!seen[$0]++' | cut -c1-220
tail -25 "$OUTDIR/gpu_bench_rest.log"
fi
stamp "done (status $status)"
exit $status
