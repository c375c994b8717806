#!/usr/bin/env bash
# Makes the freshly built package importable from PYTHON: the extension and
# libfusetrain are placed in python/fusetrain/ and python/fusetrain/lib/
# (copied, then renamed over the old ones, so a running Python keeps its
# mapped copies), and the
# environment gets an editable install pointing at python/ (once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BUILD=${2:-build}
# libfusetrain.so goes to python/fusetrain/lib, as in the wheel (Note [Wheel
# RUNPATH] in CMakeLists.txt): beside the modules it would look like one.
mkdir -p python/fusetrain/lib
rm -f python/fusetrain/libfusetrain.so  # where checkouts before the move kept it
for f in "$BUILD"/_C.*.so "$BUILD"/libfusetrain.so; do
  case $f in
    */libfusetrain.so) dest=python/fusetrain/lib/libfusetrain.so ;;
    *) dest=python/fusetrain/$(basename "$f") ;;
  esac
  cp -f "$f" "$dest.new"
  mv -f "$dest.new" "$dest"
done
if ! (cd /tmp && "$PY" -c 'import fusetrain' 2>/dev/null); then
  site=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
  if [ -w "$site" ]; then
    echo "$PWD/python" > "$site/fusetrain-dev.pth"
  else
    echo "install-python: $site is not writable; use PYTHONPATH=$PWD/python" >&2
  fi
fi
