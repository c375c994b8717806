#!/usr/bin/env bash
# Makes the freshly built package importable from PYTHON:
#
#   scripts/install-python.sh PYTHON BUILD [PACKAGE_ROOT]
#
# The extension, libfusetrain and the build record (Note [Build record] in
# CMakeLists.txt) are placed in PACKAGE_ROOT/fusetrain/ and its lib/ (copied,
# then renamed over the old ones, so a running Python keeps its mapped
# copies), and PYTHON's environment gets a .pth file naming PACKAGE_ROOT.
#
# PACKAGE_ROOT is python/ (the default), where the sources are, for the
# default torch's build. A build against another torch (TORCH_VERSION=... make)
# gets BUILD/python instead: a fusetrain/ folder of links to the sources beside
# that build's own libraries, so each venv imports the extension built for its
# torch and neither build overwrites the other's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BUILD=${2:-build}
ROOT_DIR=${3:-python}

pkg=$ROOT_DIR/fusetrain
if [ "$ROOT_DIR" != python ]; then
  mkdir -p "$pkg"
  # Links to every source entry, made afresh (a module added or removed since
  # the last build is followed); the built files are copied below.
  find "$pkg" -mindepth 1 -maxdepth 1 -type l -delete
  for entry in python/fusetrain/*; do
    case $(basename "$entry") in
      *.so | *.so.* | lib | __pycache__) continue ;;
    esac
    ln -s "$PWD/$entry" "$pkg/$(basename "$entry")"
  done
fi
# libfusetrain.so goes to lib/, as in the wheel (Note [Wheel RUNPATH] in
# CMakeLists.txt): beside the modules it would look like one.
mkdir -p "$pkg/lib"
rm -f "$pkg/libfusetrain.so"  # where checkouts before the move kept it
for f in "$BUILD"/_C.*.so "$BUILD"/libfusetrain.so "$BUILD"/build-info.json; do
  case $f in
    */_C.*.so) dest=$pkg/$(basename "$f") ;;
    *) dest=$pkg/lib/$(basename "$f") ;;
  esac
  cp -f "$f" "$dest.new"
  mv -f "$dest.new" "$dest"
done
site=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
pth="$site/fusetrain-dev.pth"
want=$(cd "$ROOT_DIR" && pwd)
if [ "$(cat "$pth" 2>/dev/null)" != "$want" ]; then
  if [ -w "$site" ]; then
    echo "$want" > "$pth"
  elif ! (cd /tmp && "$PY" -c 'import fusetrain' 2>/dev/null); then
    echo "install-python: $site is not writable; use PYTHONPATH=$want" >&2
  fi
fi
