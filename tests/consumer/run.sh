#!/usr/bin/env bash
# Shows that C++ users can use fusetrain through CMake: installs the main
# build into a temporary prefix, builds tests/consumer against it with
# find_package(fusetrain), and runs the result. Exits non-zero on any failure.
#   PYTHON  the python whose torch fusetrain was built against (.venv/bin/python)
#   BUILD   the main build directory (build)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-.venv/bin/python}
BUILD=${BUILD:-build}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/fusetrain-consumer.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake --install "$BUILD" --prefix "$TMP/prefix" >"$TMP/install.log" || {
  cat "$TMP/install.log" >&2
  echo "consumer: cmake --install $BUILD failed" >&2
  exit 1
}

# No CUDA settings here: a CUDA torch's config needs nvcc and an architecture
# list, and fusetrainConfig.cmake supplies both as a user's project needs them.
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

cmake -S tests/consumer -B "$TMP/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TMP/prefix;$TORCH_PREFIX" >"$TMP/configure.log" 2>&1 || {
  cat "$TMP/configure.log" >&2
  echo "consumer: configuring tests/consumer failed" >&2
  exit 1
}
cmake --build "$TMP/build" -j "$(nproc)" >"$TMP/build.log" 2>&1 || {
  cat "$TMP/build.log" >&2
  echo "consumer: building tests/consumer failed" >&2
  exit 1
}
"$TMP/build/consumer"
