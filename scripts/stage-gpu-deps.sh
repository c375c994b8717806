#!/usr/bin/env bash
# Stages into .gpu-deps/ the Debian-packaged headers and libraries the build
# needs and the GPU box lacks (it has torch, nvcc, cmake and ninja, but no
# apt and no network): cxxopts, Catch2, gloo's headers, yaml-cpp, nlohmann-json, zlib's
# header, and Debian's Fashion-MNIST files (32 MB) for the trainer's runs. `make gpu-check` carries the folder there; CMake finds it through
# CMAKE_PREFIX_PATH (cmake/Dependencies.cmake).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh >/dev/null
D=.gpu-deps
rm -rf "$D"
mkdir -p "$D/include" "$D/lib"
cp /usr/include/cxxopts.hpp /usr/include/zlib.h /usr/include/zconf.h "$D/include/"
cp -r /usr/include/catch2 /usr/include/gloo /usr/include/yaml-cpp /usr/include/nlohmann "$D/include/"
lib=/usr/lib/x86_64-linux-gnu
cp -L "$lib"/libyaml-cpp.so.0.7 "$D/lib/"
ln -sf libyaml-cpp.so.0.7 "$D/lib/libyaml-cpp.so"
cp -L "$lib"/libz.so.1 "$D/lib/"
ln -sf libz.so.1 "$D/lib/libz.so"
mkdir -p "$D/datasets"
cp -r /usr/share/datasets/fashion-mnist "$D/datasets/"
du -sh "$D"
