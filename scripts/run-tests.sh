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

if [ -x tests/consumer/run.sh ]; then
  echo "== C++ consumer project (find_package(fusetrain))"
  PYTHON="$PY" BUILD="$BUILD" tests/consumer/run.sh
fi

echo "== Python tests (pytest)"
"$PY" -m pytest tests/python -q
