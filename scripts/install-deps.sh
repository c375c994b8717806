#!/usr/bin/env bash
# Installs everything fusetrain needs on a fresh Debian 12 machine, and nothing
# twice: Debian packages through apt-get (as root), Python packages into a
# virtual environment with the torch asked for. Safe to run before every build.
#
#   scripts/install-deps.sh                        torch DEFAULT into .venv
#   TORCH_VERSION=2.11.0 scripts/install-deps.sh   into .venv-torch2.11.0
#
# (DEFAULT and the supported range: python/fusetrain/_torch_versions.py.)
# VENV names another folder. torch and its CUDA wheels (3-5 GB) are downloaded
# once into a wheelhouse shared by every checkout and venv on the machine
# (FUSETRAIN_WHEELHOUSE, default ~/.cache/fusetrain/wheels; PyPI's index sends
# no caching headers, so pip's own cache keeps none of them).
set -euo pipefail
cd "$(dirname "$0")/.."

versions=python/fusetrain/_torch_versions.py
field() { sed -n "s/^$1 = \"\([0-9.]*\)\".*/\1/p" "$versions"; }
DEFAULT_TORCH=$(field DEFAULT)
TORCH_VERSION=${TORCH_VERSION:-$DEFAULT_TORCH}
minor=$(echo "$TORCH_VERSION" | cut -d. -f1,2)
in_range=$(printf '%s\n' "$(field OLDEST)" "$minor" "$(field NEWEST)" | sort -V | sed -n 2p)
if [ "$in_range" != "$minor" ]; then
  echo "install-deps: TORCH_VERSION=$TORCH_VERSION is outside the supported torch $(field OLDEST) through $(field NEWEST)" >&2
  exit 2
fi
if [ -z "${VENV:-}" ]; then
  if [ "$TORCH_VERSION" = "$DEFAULT_TORCH" ]; then VENV=.venv; else VENV=.venv-torch$TORCH_VERSION; fi
fi
WHEELHOUSE=${FUSETRAIN_WHEELHOUSE:-$HOME/.cache/fusetrain/wheels}
APT_PACKAGES=(cmake ninja-build ccache g++ libcxxopts-dev catch2 libyaml-cpp-dev nlohmann-json3-dev libgloo-dev
              zlib1g-dev dataset-fashion-mnist bible-kjv iproute2 nftables)
PY_PACKAGES=(numpy pytest pybind11 matplotlib pyyaml setuptools wheel safetensors)
# The optional integrations' libraries (setup.py's extras), which their tests
# run against: fusetrain itself imports without any of them. Minimum versions
# only; the constraint keeps pip from replacing the pinned torch.
EXTRA_PY_PACKAGES=("lightning>=2.4" "transformers>=4.46" "accelerate>=1.0" "sphinx>=7.2" "myst-parser>=3.0" "furo>=2024.1.29")

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: apt-get install ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps: need root to install ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# configs/gpt_text.yaml's corpus: the King James Bible as plain text (4.3 MB),
# decoded from the package bible-kjv-text by its `bible` program.
if [ ! -s data/kjv.txt ] && command -v bible >/dev/null; then
  mkdir -p data
  bible "Gen1:1-Rev22:21" > data/kjv.txt.tmp && mv data/kjv.txt.tmp data/kjv.txt
fi

# PYTHON overrides the virtual environment (the GPU box brings its own torch).
if [ -n "${PYTHON:-}" ]; then
  exit 0
fi
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  echo "install-deps: creating $VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
fi
have_torch=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have_torch" != "$TORCH_VERSION" ]; then
  echo "install-deps: installing torch==$TORCH_VERSION into $VENV"
  mkdir -p "$WHEELHOUSE"
  # Already there: only the index is asked (a few seconds).
  "$PY" -m pip download -q -d "$WHEELHOUSE" "torch==$TORCH_VERSION"
  "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" "torch==$TORCH_VERSION"
fi
# The constraint keeps pip from replacing the torch asked for; the
# integrations then resolve to releases that declare support for it.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" > "$constraints"
# The requirements whose distribution is not installed, in one interpreter
# start (a `pip show` each took most of a second: half a minute of every make).
mapfile -t need_py < <("$PY" - "${PY_PACKAGES[@]}" "${EXTRA_PY_PACKAGES[@]}" <<'PY'
import importlib.metadata as metadata, re, sys
for requirement in sys.argv[1:]:
    try:
        metadata.version(re.split(r"[<>=]", requirement)[0])
    except metadata.PackageNotFoundError:
        print(requirement)
PY
)
if ((${#need_py[@]})); then
  echo "install-deps: pip install ${need_py[*]} into $VENV"
  "$PY" -m pip install -q -c "$constraints" "${need_py[@]}"
fi
