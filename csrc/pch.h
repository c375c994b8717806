// Precompiled header for every torch-including target: the torch headers
// cost 20-40 s per file on two cores, so they are parsed once per build.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>
