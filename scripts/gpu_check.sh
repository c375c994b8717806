#!/usr/bin/env bash
# The one prepared run for the GPU box (`make gpu-check`): builds with CUDA
# against this machine's torch, runs every CUDA test (the Catch2 [cuda] cases
# and the pytest `cuda` marker), a trainer run with CUDA graphs, and the
# benchmark suite on the GPU; logs and results go to bench/results/ and to
# $OUT when set, with a summary last. Budget: about 8 minutes on one H200
# with 16 cores (each stage has a timeout, so one that hangs cannot eat the
# others' time; a stage that reaches its cap is named as such at the end).
#
# On the device tool: carry [".gpu-deps"] (scripts/stage-gpu-deps.sh makes it
# here first: headers, libraries and Fashion-MNIST the box lacks) and run
# `bash scripts/gpu_check.sh`. The CPU-only tests are CI's job, not this one's.
#
# `bash scripts/gpu_check.sh test` stops after the tests and `... bench` skips
# them: two calls on a warm machine (the build in build-gpu/ stays between
# calls, so the second one only relinks) split one long run into two that
# each fit a device call with room to spare.
# $OUT gets 11 logs and this run's results JSON (bench/run.py's, hf_finetune-large-<gpu>-<date>.json, and
# bench_fsdp2.py's fsdp2-<gpu>-<date>.json and fsdp2-large-...): gpu_build,
# gpu_cpp_tests, gpu_py_tests, gpu_bench (headline), gpu_bench_fp8 (float8 vs
# bf16, bench/bench_fp8.py, ~30-60 s), gpu_bench_lce (linear cross-entropy),
# gpu_bench_fsdp2 (FSDP2, issue 41), gpu_bench_hf_finetune (issue 51), gpu_bench_integrations (Lightning, HF
# Trainer; issue 39), gpu_bench_rest, gpu_trainer. The device
# tool returns at most 8 files, so when $OUT is set and holds more, the logs
# go into one gpu_logs.tar.gz at the end (the JSON stay loose).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
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
# Stages cut off at their cap and stages left out, repeated at the end (the
# device tool returns only the output's tail).
capped=()
skipped=()
# run_stage NAME CAP LOG CMD...: CMD with its output in LOG, stopped after
# CAP seconds (killed 10 s later if it ignores that); a cap that hits is
# said, naming the stage, and counts as a failure. Returns CMD's status
# (124 or 137 when capped).
run_stage() {
  local name=$1 cap=$2 log=$3 rc
  shift 3
  timeout -k 10 "$cap" "$@" > "$log" 2>&1
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    capped+=("$name (${cap}s)")
    fail "$name: TIMED OUT at its ${cap}s cap; whatever had not run by then is lost (log: $log)"
  elif [ "$rc" -ne 0 ]; then
    fail "$name (exit $rc; log: $log)"
  fi
  return "$rc"
}
# python_headers PY: "ok DIR" where CMake's FindPython will find a Python.h
# of PY's own version, else "missing WHY". It looks where
# FindPython does (CMake 3.25, tried with a python without headers): the
# interpreter's include dirs (sysconfig) and the include/ of each prefix in
# CMAKE_PREFIX_PATH, here .gpu-deps/include (not include/pythonX.Y there).
python_headers() {
  "$1" -c '
import os, re, sys, sysconfig
want = sys.version_info[:2]
dirs = [sysconfig.get_path("include"), sysconfig.get_path("platinclude"), os.path.join(".gpu-deps", "include")]
dirs = [d for i, d in enumerate(dirs) if d and d not in dirs[:i]]
for d in dirs:
    try:
        with open(os.path.join(d, "patchlevel.h")) as f:
            text = f.read()
    except OSError:
        continue
    version = tuple(int(re.search(r"#define\s+PY_%s_VERSION\s+(\d+)" % k, text).group(1)) for k in ("MAJOR", "MINOR"))
    if version == want and os.path.isfile(os.path.join(d, "Python.h")):
        print("ok", d)
        sys.exit()
print("missing Python %d.%d; looked in %s" % (want + (", ".join(dirs),)))
' 2>/dev/null || echo "missing $1 did not run"
}
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

# fusetrain._C needs Python's headers, and every Python stage (the CUDA
# pytest cases, the benchmarks) imports it. Without them CMake only warns and
# builds no module, and each Python stage would then die at import. So look
# first and say so in one line; then build without the module, skip the
# Python stages, and still run the C++ [cuda] cases and the CUDA trainer run:
# a fresh box costs minutes of a 15-minute budget, and failing here would
# spend them with no result at all, while the headers cannot be fetched on
# the box anyway (carry them in .gpu-deps/include, or use a PYTHON that has
# them). The run still ends with a nonzero status.
read -r py_state py_where <<< "$(python_headers "$PY")"
if [ "$py_state" = ok ]; then
  with_python=ON
else
  with_python=OFF
  skipped+=("Python stages (CUDA pytest, benchmarks): no Python.h")
  fail "no Python.h for $PY ($py_where): building without fusetrain._C and SKIPPING the Python stages (CUDA pytest, benchmarks); the C++ [cuda] tests and the trainer still run"
fi

stamp "configure + build (CUDA, sm_90)"
prefix="$PWD/.gpu-deps"
export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! run_stage "build" "$(cap_for 300 "$after_build")" "$OUTDIR/gpu_build.log" \
  bash -c "cmake -S . -B '$BUILD' -G Ninja -DPython3_EXECUTABLE='$(command -v "$PY")' \
  -DCMAKE_PREFIX_PATH='$prefix' -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFUSETRAIN_PYTHON=$with_python -DCMAKE_BUILD_TYPE=Release && cmake --build '$BUILD' -j $(nproc)"; then
  tail -40 "$OUTDIR/gpu_build.log"
  echo "gpu-check: build failed (log: $OUTDIR/gpu_build.log)"
  [ "${#capped[@]}" -gt 0 ] && echo "!! TIMED OUT: ${capped[*]}: nothing after the build ran"
  exit 1
fi
if [ "$with_python" = ON ] && ! compgen -G "$BUILD/_C.*.so" > /dev/null; then
  # The look-up above and CMake's disagreed: the configure log says why.
  with_python=OFF
  skipped+=("Python stages (CUDA pytest, benchmarks): CMake built no fusetrain._C")
  fail "CMake built no fusetrain._C (see 'Python' in $OUTDIR/gpu_build.log): SKIPPING the Python stages"
fi
if [ "$with_python" = ON ]; then
  mkdir -p python/fusetrain/lib
  cp -f "$BUILD"/_C.*.so python/fusetrain/
  cp -f "$BUILD"/libfusetrain.so "$BUILD"/build-info.json python/fusetrain/lib/
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export FUSETRAIN_BUILD_DIR="$PWD/$BUILD"
"$BUILD"/fusetrain info

if [ "$WHAT" != bench ]; then
stamp "C++ CUDA tests (Catch2 [cuda] cases)"
# Only the [cuda] cases: the CPU cases (multi-process worlds with their
# timeouts) are CI's, and run first they used up the cap before most [cuda]
# cases began. --durations prints a line as each case's run ends, which tells
# the cases a cap cut off from those that ran.
cpp_log="$OUTDIR/gpu_cpp_tests.log"
cpp_cases=$("$BUILD"/fusetrain_tests --list-test-names-only "[cuda]" 2>/dev/null | grep -v '^$')
echo "$(grep -c . <<< "$cpp_cases") [cuda] cases"
run_stage "C++ [cuda] tests" "$(cap_for 90 "$after_cpp")" "$cpp_log" \
  "$BUILD"/fusetrain_tests "[cuda]" --durations yes --warn NoTests
cpp_rc=$?
grep -E "FAILED|passed|failed|test cases" "$cpp_log" | tail -5
if [ "$cpp_rc" -eq 124 ] || [ "$cpp_rc" -eq 137 ]; then
  lost=$(while IFS= read -r name; do
    [ -n "$name" ] && ! grep -qF -- " s: $name" "$cpp_log" && echo "  $name"
  done <<< "$cpp_cases")
  echo "!! C++ [cuda] cases that never finished a run before the cap (lost): $(grep -c . <<< "$lost") of $(grep -c . <<< "$cpp_cases")"
  echo "$lost"
fi

if [ "$with_python" = ON ]; then
stamp "Python CUDA tests"
# Every test marked @pytest.mark.cuda (tests/python/conftest.py), selected by
# the marker rather than by name; a per-test limit where pytest-timeout is
# installed (the GPU box has it).
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
run_stage "Python CUDA tests" "$(cap_for 150 "$after_py")" "$OUTDIR/gpu_py_tests.log" \
  "$PY" -m pytest tests/python -q -p no:cacheprovider -m cuda "${per_test[@]}" -rfE
grep -E "^(FAILED|ERROR)|passed|failed" "$OUTDIR/gpu_py_tests.log" | tail -15
fi
fi

if [ "$WHAT" != test ]; then

if [ "$with_python" = ON ]; then
# The headline modules first (step fusion, end to end, the trainer with
# graphs), then the rest of the suite in what time is left.
stamp "benchmarks (GPU): graph, e2e, trainer"
run_stage "benchmarks (headline)" "$(cap_for 200 60)" "$OUTDIR/gpu_bench.log" \
  "$PY" bench/run.py --device cuda --results-dir "$RESULTS" --only graph --only e2e --only trainer
# Float8 against bf16 (a Linear, the crossover sweep behind
# DEFAULT_FP8_MIN_FEATURES, a 1B-scale GPT block, a small GPT trained 50
# steps): about 30-60 s on an H200.
stamp "benchmarks (GPU): fp8"
run_stage "benchmarks (fp8)" "$(cap_for 120 60)" "$OUTDIR/gpu_bench_fp8.log" \
  "$PY" bench/run.py --device cuda --results-dir "$RESULTS" --only fp8
# Issue 38: the chunked linear + cross-entropy against eager F.linear +
# F.cross_entropy at 16384 x 4096 -> 128256 bf16 (goals: >= 1.3x the time,
# <= 1/10 of the memory); a few seconds of GEMMs.
stamp "benchmarks (GPU): linear cross-entropy"
run_stage "benchmarks (linear cross-entropy)" "$(cap_for 120 30)" "$OUTDIR/gpu_bench_lce.log" \
  "$PY" bench/run.py --device cuda --results-dir "$RESULTS" --only linear_cross_entropy
# Issue 52: the fused transformer-block ops (norms with the residual, bias +
# GELU, SwiGLU, rotary) against torch eager at 8192 x {768, 2048, 4096},
# bf16 and fp32, forward + backward, with each one's bandwidth against a
# device copy; a few seconds.
stamp "benchmarks (GPU): block ops"
run_stage "benchmarks (block ops)" "$(cap_for 120 30)" "$OUTDIR/gpu_bench_block_ops.log" \
  "$PY" bench/run.py --device cuda --results-dir "$RESULTS" --only block_ops
# Issue 51: fine-tuning a ~200M-parameter Llama from a Hugging Face folder,
# the CLI (model.pretrained) against the Hugging Face Trainer and a plain
# loop, bf16, 30 steps each; only where the box has transformers.
stamp "benchmarks (GPU): hf_finetune"
if "$PY" -c "import transformers" 2>/dev/null; then
  run_stage "benchmarks (hf_finetune)" "$(cap_for 150 30)" "$OUTDIR/gpu_bench_hf_finetune.log" \
    "$PY" bench/bench_hf_finetune.py --device cuda --large --results-dir "$RESULTS"
else
  skipped+=("the Llama fine-tune benchmark: the box has no transformers")
fi
# Issue 41: FSDP2 on the GPU, one rank (NCCL), fully_shard on a 1-rank mesh
# so the parameters are DTensors: FusedAdamW's opt.step() against torch's
# AdamW fused and foreach, the 10.5M GPT and a 117M one (--size large),
# float32; a standalone script (bench/bench_fsdp2.py), about 15-30 s a size,
# most of it start-up. Each size's own deadline is under the stage's cap, so
# a hang is named with the worker's log.
stamp "benchmarks (GPU): fsdp2"
fsdp2_cap=$(cap_for 90 30)
# shellcheck disable=SC2016  # ($0, $1, $2: bash -c's own arguments)
run_stage "benchmarks (fsdp2)" "$fsdp2_cap" "$OUTDIR/gpu_bench_fsdp2.log" \
  bash -c 'rc=0; for size in default large; do
    "$0" bench/bench_fsdp2.py --device cuda --size "$size" --results-dir "$1" --deadline "$2" || rc=$?
  done; exit $rc' "$PY" "$RESULTS" "$(( fsdp2_cap > 20 ? fsdp2_cap - 10 : fsdp2_cap ))"
# Issue 39: the integrations, one rank on the GPU. Lightning from the wheels
# scripts/stage-gpu-deps.sh puts in .gpu-deps/wheels (pure Python; installed
# offline unless the box has it); the Hugging Face Trainer row only where the
# box already has transformers and accelerate (their binary wheels are not
# carried). Both rows go into bench/run.py's results JSON.
stamp "benchmarks (GPU): lightning, hf_trainer"
integrations=()
if ! "$PY" -c "import lightning" 2>/dev/null && [ -d .gpu-deps/wheels ]; then
  "$PY" -m pip install -q --no-index --find-links .gpu-deps/wheels lightning >"$OUTDIR/gpu_bench_integrations.log" 2>&1 ||
    echo "pip could not install lightning from .gpu-deps/wheels (log: gpu_bench_integrations)"
fi
"$PY" -c "import lightning" 2>/dev/null && integrations+=(--only lightning) ||
  skipped+=("the Lightning benchmark: lightning does not import (make gpu-deps stages its wheels)")
"$PY" -c "import transformers, accelerate" 2>/dev/null && integrations+=(--only hf_trainer) ||
  skipped+=("the HF Trainer benchmark: the box has no transformers + accelerate")
if ((${#integrations[@]})); then
  run_stage "benchmarks (integrations)" "$(cap_for 120 30)" "$OUTDIR/gpu_bench_integrations.log" \
    "$PY" bench/run.py --device cuda --results-dir "$RESULTS" "${integrations[@]}"
fi
stamp "benchmarks (GPU): amp, optim, cross_entropy, ddp"
run_stage "benchmarks (rest)" "$(cap_for 150 30)" "$OUTDIR/gpu_bench_rest.log" \
  "$PY" bench/run.py --device cuda --results-dir "$RESULTS" --quick \
  --only amp --only optim --only cross_entropy --only ddp
find "$RESULTS" -maxdepth 1 -name '*.json' -newer "$run_marker" -exec cp -f {} "$OUTDIR"/ \; 2>/dev/null || true
fi

stamp "trainer on CUDA: Fashion-MNIST CNN, mixed_bfloat16, 16 steps per CUDA graph"
if [ -f "${FUSETRAIN_FASHION_MNIST:-$FASHION}/train-images-idx3-ubyte.gz" ]; then
  run_stage "trainer run" "$(cap_for 60)" "$OUTDIR/gpu_trainer.log" \
    "$BUILD"/fusetrain train --config configs/fashion_mnist.yaml --device cuda \
    --set runtime.nproc=1 --set "data.path=${FUSETRAIN_FASHION_MNIST:-$FASHION}" \
    --steps-per-execution 16 --run-dir /tmp/fusetrain-gpu-run --set output.progress=lines
  grep -E "^epoch|^done|rror" "$OUTDIR/gpu_trainer.log" | tail -8
else
  fail "no Fashion-MNIST files: run scripts/stage-gpu-deps.sh and carry .gpu-deps"
fi

stamp "summary"
if [ "$with_python" = ON ]; then
tail -45 "$OUTDIR/gpu_bench.log"
# fp8: the crossover and final-loss lines, and the headline rows (notes cut).
grep -E "^fp8 (crossover|gpt:)" "$OUTDIR/gpu_bench_fp8.log"
grep -E "^\| fp8 (linear|GEMM|crossover|GPT block|gpt train,)" "$OUTDIR/gpu_bench_fp8.log" | awk '!seen[$0]++' | cut -c1-220
# fsdp2: each size's parameter count, its table and the parameter check (or the error).
grep -E "^([0-9.]+M parameters|\| (optimizer|fusetrain|torch) |final parameters|peak CUDA|bench_fsdp2: --device|[A-Za-z]*Error)" \
  "$OUTDIR/gpu_bench_fsdp2.log"
# linear cross-entropy: ours vs eager, vs the GEMM floor, and the chunk sweep.
[ -f "$OUTDIR/gpu_bench_lce.log" ] && grep -E "^\| linear\+CE" "$OUTDIR/gpu_bench_lce.log" | awk '!seen[$0]++' | cut -c1-600
[ -f "$OUTDIR/gpu_bench_integrations.log" ] && grep -E "^\| (lightning|hf trainer)" "$OUTDIR/gpu_bench_integrations.log" | awk '!seen[$0]++' | cut -c1-220
tail -25 "$OUTDIR/gpu_bench_rest.log"
fi
fi
# At most 8 files come back from $OUT (the device tool's limit): past that,
# one archive of the logs (after the summary, which reads them).
if [ -n "${OUT:-}" ] && [ "$(find "$OUTDIR" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  if (cd "$OUTDIR" && tar -czf gpu_logs.tar.gz ./*.log && rm -f ./*.log); then
    echo "== $OUTDIR: more than 8 files, so the logs are in $OUTDIR/gpu_logs.tar.gz"
  else
    echo "!! could not archive the logs: the device tool returns only 8 of the files in $OUTDIR"
  fi
fi
for s in "${capped[@]}"; do echo "!! TIMED OUT (cases or steps after the cap were lost): $s"; done
for s in "${skipped[@]}"; do echo "!! SKIPPED: $s"; done
stamp "done (status $status)"
exit $status
