// CUDA test cases: tagged [cuda], and they fail without a GPU rather than
// pass empty. scripts/run-tests.sh excludes them ("~[cuda]") where torch sees
// no GPU, so a CPU run neither counts them as passed nor hides that they did
// not run; scripts/gpu_check.sh runs them on the GPU box.
#pragma once

#include <catch2/catch.hpp>
#include <torch/cuda.h>

#define REQUIRE_CUDA()                                                              \
  do {                                                                              \
    INFO("a [cuda] test case: run it on a GPU (make gpu-check) or exclude \"[cuda]\""); \
    REQUIRE(torch::cuda::is_available());                                           \
  } while (0)
