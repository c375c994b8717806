#!/usr/bin/env bash
# The one prepared run for the GPU box (`make gpu-check`): builds with CUDA
# against this machine's torch, runs every test (the CUDA ones no longer
# skip), runs the benchmark suite on the GPU, and writes logs and results to
# bench/results/ and to $OUT when set, printing a short table last. Budget:
# about 8 minutes on one H200 with 16 cores.
#
# On the device tool: carry [".gpu-deps"] (scripts/stage-gpu-deps.sh makes it
# here first) and run `bash scripts/gpu_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=bench/results
OUTDIR=${OUT:-$RESULTS}
mkdir -p "$RESULTS" "$OUTDIR"
BUILD=build-gpu
status=0
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 ))s] $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'

stamp "configure + build (CUDA, sm_90)"
prefix="$PWD/.gpu-deps"
cmake -S . -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
  -DCMAKE_PREFIX_PATH="$prefix" -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_BUILD_TYPE=Release \
  > "$OUTDIR/gpu_build.log" 2>&1 &&
  cmake --build "$BUILD" -j "$(nproc)" >> "$OUTDIR/gpu_build.log" 2>&1
if [ $? -ne 0 ]; then
  tail -40 "$OUTDIR/gpu_build.log"
  echo "gpu-check: build failed (log: $OUTDIR/gpu_build.log)"
  exit 1
fi
cp -f "$BUILD"/_C.*.so "$BUILD"/libfusetrain.so python/fusetrain/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export FUSETRAIN_BUILD_DIR="$PWD/$BUILD"
"$BUILD"/fusetrain info

stamp "C++ tests"
"$BUILD"/fusetrain_tests > "$OUTDIR/gpu_cpp_tests.log" 2>&1 || status=1
tail -3 "$OUTDIR/gpu_cpp_tests.log"

stamp "Python tests"
timeout 240 "$PY" -m pytest tests/python -q -x -p no:cacheprovider > "$OUTDIR/gpu_py_tests.log" 2>&1 || status=1
tail -3 "$OUTDIR/gpu_py_tests.log"

stamp "benchmarks (GPU)"
timeout 300 "$PY" bench/run.py --device cuda --results-dir "$RESULTS" > "$OUTDIR/gpu_bench.log" 2>&1 || status=1
cp -f "$RESULTS"/*"$(date +%Y-%m-%d)"*.json "$OUTDIR"/ 2>/dev/null || true

stamp "summary"
cat "$OUTDIR/gpu_bench.log" | tail -40
exit $status
