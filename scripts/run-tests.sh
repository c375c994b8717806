#!/usr/bin/env bash
# Runs every test that this machine can run: the Catch2 binary (CUDA cases
# skip without a GPU), the find_package consumer project, then pytest (its
# summary line closes the output).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BUILD=${2:-build}

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
if [ -x "$BUILD"/fusetrain_kernel_tests ]; then
  "$BUILD"/fusetrain_kernel_tests
  CUDA_EMULATOR_ORDER=reverse "$BUILD"/fusetrain_kernel_tests
  # No leak report: libtorch and the OpenMP runtime (not instrumented) keep
  # allocations for the process's life.
  ASAN_OPTIONS=detect_leaks=0 "$BUILD"/fusetrain_kernel_tests_sanitized
else
  echo "fusetrain_kernel_tests was not built (no cuda_fp16.h: see the CMake output)"
  exit 1
fi

if [ -x tests/consumer/run.sh ]; then
  echo "== C++ consumer project (find_package(fusetrain))"
  PYTHON="$PY" BUILD="$BUILD" tests/consumer/run.sh
fi

echo "== Python tests (pytest)"
"$PY" -m pytest tests/python -q
