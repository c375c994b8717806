#!/usr/bin/env bash
# Runs every test that this machine can run: the Catch2 binary (CUDA cases
# skip without a GPU), the find_package consumer project, then pytest (its
# summary line closes the output).
#
#   scripts/run-tests.sh PYTHON BUILD [quick]
#
# quick (make test-quick; CI's leg on the oldest supported torch): the Catch2
# and kernel-emulator tests, then only the pytest cases listed in
# tests/python/quick.txt, which reach every module of the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BUILD=${2:-build}
MODE=${3:-full}
# The tests that start the CLI or a Python of their own find this build's.
export FUSETRAIN_BUILD_DIR=$(cd "$BUILD" && pwd)
export FUSETRAIN_PYTHON=$PY
echo "== torch $("$PY" -c 'import torch; print(torch.__version__)') ($PY), build $BUILD"

echo "== C++ tests (Catch2)"
# [cuda] cases fail without a GPU (tests/cpp/cuda_test.h): where torch sees
# none they are left out, and the count of those left out is printed.
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  "$BUILD"/fusetrain_tests
else
  cuda_cases=$("$BUILD"/fusetrain_tests --list-test-names-only "[cuda]" | grep -c . || true)
  echo "no GPU: leaving out the $cuda_cases [cuda] test cases (make gpu-check runs them)"
  "$BUILD"/fusetrain_tests "~[cuda]"
fi

echo "== CUDA kernels on the CPU (tests/cuda_emulator): in order, reversed, sanitized"
if [ ! -x "$BUILD"/fusetrain_kernel_tests ]; then
  echo "fusetrain_kernel_tests was not built (no cuda_fp16.h: see the CMake output)"
  exit 1
fi
# The three runs are independent single-threaded processes: run side by side
# (about half the wall time on two cores), each output shown in full after.
kernel_logs=$(mktemp -d)
trap 'rm -rf "$kernel_logs"' EXIT
"$BUILD"/fusetrain_kernel_tests >"$kernel_logs/order" 2>&1 &
forward_pid=$!
CUDA_EMULATOR_ORDER=reverse "$BUILD"/fusetrain_kernel_tests >"$kernel_logs/reverse" 2>&1 &
reverse_pid=$!
# No leak report: libtorch and the OpenMP runtime (not instrumented) keep
# allocations for the process's life.
ASAN_OPTIONS=detect_leaks=0 "$BUILD"/fusetrain_kernel_tests_sanitized >"$kernel_logs/sanitized" 2>&1 &
sanitized_pid=$!
kernel_status=0
for run in "order:$forward_pid" "reverse:$reverse_pid" "sanitized:$sanitized_pid"; do
  name=${run%%:*}
  if wait "${run##*:}"; then result=passed; else result=FAILED; kernel_status=1; fi
  echo "-- kernel tests, $name: $result"
  cat "$kernel_logs/$name"
done
[ "$kernel_status" -eq 0 ] || exit 1

if [ "$MODE" = quick ]; then
  echo "== Python tests (pytest), the quick selection (tests/python/quick.txt)"
  mapfile -t selection < <(grep -v -e '^#' -e '^$' tests/python/quick.txt | sed 's|^|tests/python/|')
  exec "$PY" -m pytest -q "${selection[@]}"
fi

if [ -x tests/consumer/run.sh ]; then
  echo "== C++ consumer project (find_package(fusetrain))"
  PYTHON="$PY" BUILD="$BUILD" tests/consumer/run.sh
fi

echo "== Python tests (pytest)"
"$PY" -m pytest tests/python -q
