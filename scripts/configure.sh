#!/usr/bin/env bash
# Configures the CMake tree BUILD for PYTHON's torch (make configure):
#
#   scripts/configure.sh PYTHON BUILD [CMAKE_ARGS...]
#
# Nothing to do when BUILD was configured for this interpreter and the torch
# it has now. Configured afresh (cmake --fresh: no cached path of another
# torch survives) when PYTHON is another interpreter or its torch changed
# since, so `make build PYTHON=...` and a torch upgrade in the venv rebuild
# against the torch that will import the result.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$1
BUILD=$2
shift 2

torch_now=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
configured_py=$(sed -n 's/^Python3_EXECUTABLE:[A-Z]*=//p' "$BUILD/CMakeCache.txt" 2>/dev/null || true)
configured_torch=$(sed -n 's/^ *"torch": "\(.*\)",$/\1/p' "$BUILD/build-info.json" 2>/dev/null || true)
if [ -f "$BUILD/build.ninja" ] && [ "$configured_py" = "$PY" ] && [ "$configured_torch" = "$torch_now" ]; then
  exit 0
fi
fresh=()
if [ -f "$BUILD/CMakeCache.txt" ]; then
  echo "configure: $BUILD was for ${configured_py:-?} (torch ${configured_torch:-?}); now $PY (torch $torch_now)"
  fresh=(--fresh)
fi
exec cmake "${fresh[@]}" -S . -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$PY" "$@"
