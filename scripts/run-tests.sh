#!/usr/bin/env bash
# Runs every test that this machine can run: the Catch2 binary (CUDA cases
# skip without a GPU), the find_package consumer project, then pytest (its
# summary line closes the output).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BUILD=${2:-build}

echo "== C++ tests (Catch2)"
"$BUILD"/fusetrain_tests

if [ -x tests/consumer/run.sh ]; then
  echo "== C++ consumer project (find_package(fusetrain))"
  PYTHON="$PY" BUILD="$BUILD" tests/consumer/run.sh
fi

echo "== Python tests (pytest)"
"$PY" -m pytest tests/python -q
