// The mixed-precision kernels (csrc/kernels/amp_kernels.cu) run through the
// CUDA emulator against the CPU ops of csrc/ops/cpu/amp_cpu.cpp, bit for bit: the
// unscale is one rounded product per element and the scale update is integer
// and double arithmetic, the same on both.
#include <fusetrain/ops/amp.h>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "amp_kernels.h"
#include "kernel_test.h"

namespace {

using fusetrain::kernels::launch_non_finite_check_and_unscale;
using fusetrain::kernels::launch_update_scale;
using kernel_test::at_offset;
using kernel_test::float_type;

// Launch layout of csrc/kernels/multi_tensor_apply.cuh: 64K-element chunks,
// (32000 - 256) / 24 = 1322 tensors of one pointer each per launch.
constexpr int64_t kChunk = 65536;
constexpr int kUnscaleTensorsPerLaunch = 1322;

struct Unscaled {
  std::vector<at::Tensor> tensors;
  float found_inf;
};

Unscaled unscale_on_emulator(const std::vector<at::Tensor>& inputs, float inv_scale,
                             int max_blocks) {
  Unscaled out{{}, 0.f};
  std::vector<void*> ptrs;
  std::vector<int64_t> numel;
  for (const at::Tensor& t : inputs) {
    out.tensors.push_back(kernel_test::copy_in_place_of(t));
    ptrs.push_back(out.tensors.back().data_ptr());
    numel.push_back(t.numel());
  }
  const float inv = inv_scale;
  REQUIRE_LAUNCH(launch_non_finite_check_and_unscale(
      float_type(inputs[0].scalar_type()), ptrs.data(), numel.data(),
      static_cast<int>(inputs.size()), &out.found_inf, &inv, max_blocks, nullptr));
  return out;
}

Unscaled unscale_on_cpu(const std::vector<at::Tensor>& inputs, float inv_scale) {
  Unscaled out{{}, 0.f};
  for (const at::Tensor& t : inputs) out.tensors.push_back(t.clone());
  at::Tensor found = at::zeros({1});
  fusetrain::ops::non_finite_check_and_unscale_(out.tensors, found, at::full({1}, inv_scale));
  out.found_inf = found.item<float>();
  return out;
}

// Tensors of every size class the launch layout distinguishes, each placed
// at its own misalignment (0-7 elements) by unscale_on_emulator.
// Where non-finite values go: none; an inf and a -inf that are the last
// elements their threads read, and a NaN mid-chunk; or that NaN alone, so
// that a thread reads finite values after it (a flag overwritten rather than
// or-ed would lose it).
enum class NonFinite { kNone, kTailsAndMid, kMidOnly };

std::vector<at::Tensor> size_classes(at::ScalarType dtype, NonFinite non_finite) {
  const std::vector<int64_t> sizes = {0, 1, 7, 15, 16, 17, 255, kChunk - 1, kChunk, kChunk + 1,
                                      278011};
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    at::Tensor t = at_offset((at::randn({sizes[i]}, at::kDouble) * 300).to(dtype),
                             static_cast<int64_t>(i % 8));
    tensors.push_back(t);
  }
  if (non_finite != NonFinite::kNone) {
    tensors[10][200000] = std::numeric_limits<double>::quiet_NaN();
  }
  if (non_finite == NonFinite::kTailsAndMid) {
    tensors[9][kChunk] = std::numeric_limits<double>::infinity();  // the second chunk's tail
    tensors[10][278010] = -std::numeric_limits<double>::infinity();  // the last element
  }
  return tensors;
}

}  // namespace

TEST_CASE("unscale kernel equals the CPU op bit for bit over sizes, tails and misalignment",
          "[kernels][amp]") {
  at::manual_seed(1);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kHalf, at::kBFloat16, at::kDouble);
  // 1: the kernel only checks (no writes); 2^-10: exact; 0.37: every product rounds.
  const float inv_scale = GENERATE(1.f, 0x1p-10f, 0.37f);
  const NonFinite non_finite =
      GENERATE(NonFinite::kNone, NonFinite::kTailsAndMid, NonFinite::kMidOnly);
  // One block striding over every chunk, a few, and one per chunk.
  const int max_blocks = GENERATE(1, 3, 1000);
  CAPTURE(dtype, inv_scale, non_finite, max_blocks);

  const std::vector<at::Tensor> inputs = size_classes(dtype, non_finite);
  const Unscaled gpu = unscale_on_emulator(inputs, inv_scale, max_blocks);
  const Unscaled cpu = unscale_on_cpu(inputs, inv_scale);
  CHECK(gpu.found_inf == (non_finite != NonFinite::kNone ? 1.f : 0.f));
  CHECK(gpu.found_inf == cpu.found_inf);
  for (size_t i = 0; i < inputs.size(); ++i) {
    CAPTURE(i, inputs[i].numel());
    REQUIRE_BITS_EQUAL(gpu.tensors[i], cpu.tensors[i]);
  }
}

TEST_CASE("unscale kernel splits a list longer than one parameter block into launches",
          "[kernels][amp]") {
  at::manual_seed(2);
  const int n = kUnscaleTensorsPerLaunch + 78;
  // The one non-finite element is in the first or the last launch.
  const int bad = GENERATE_COPY(0, n - 1);
  CAPTURE(bad);
  std::vector<at::Tensor> inputs;
  for (int i = 0; i < n; ++i) inputs.push_back(at::randn({1 + (i * 37) % 300}));
  inputs[bad][0] = std::numeric_limits<float>::infinity();

  const int64_t launches_before = cuda_emu::counts().launches;
  const Unscaled gpu = unscale_on_emulator(inputs, 0.25f, 2);
  CHECK(cuda_emu::counts().launches - launches_before == 2);
  const Unscaled cpu = unscale_on_cpu(inputs, 0.25f);
  CHECK(gpu.found_inf == 1.f);
  for (int i = 0; i < n; ++i) {
    CAPTURE(i);
    REQUIRE_BITS_EQUAL(gpu.tensors[i], cpu.tensors[i]);
  }
}

TEST_CASE("unscale kernel leaves found_inf alone when every element is finite",
          "[kernels][amp]") {
  // found_inf accumulates over calls (GradScaler unscales group by group):
  // a clean list must not reset a 1 from an earlier one.
  std::vector<void*> ptrs;
  at::Tensor t = at::ones({100});
  ptrs.push_back(t.data_ptr());
  const int64_t numel = 100;
  float found_inf = 1.f;
  const float inv = 0.5f;
  REQUIRE_LAUNCH(launch_non_finite_check_and_unscale(kernel_test::FloatType::kFloat32, ptrs.data(),
                                                     &numel, 1, &found_inf, &inv, 4, nullptr));
  CHECK(found_inf == 1.f);
  CHECK(at::equal(t, at::full({100}, 0.5f)));
}

TEST_CASE("update_scale kernel follows the CPU op's state machine", "[kernels][amp]") {
  struct Case {
    double growth, backoff;
    int64_t interval;
    double max_scale;
    int64_t hysteresis;
    float start;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const Case c = GENERATE_COPY(Case{2.0, 0.5, 3, inf, 0, 65536.f},   // torch's defaults, short interval
                               Case{2.0, 0.5, 1, inf, 2, 1.f},       // growth every step, hysteresis
                               Case{3.0, 0.25, 2, 1000.0, 1, 100.f},  // growth capped at max_scale
                               Case{1e30, 0.5, 1, inf, 0, 3e38f},    // growth to inf is refused
                               Case{2.0, 0.5, 2, inf, 0, std::numeric_limits<float>::quiet_NaN()});
  CAPTURE(c.growth, c.backoff, c.interval, c.max_scale, c.hysteresis, c.start);
  fusetrain::ops::ScaleUpdateOptions options;
  options.growth_factor = c.growth;
  options.backoff_factor = c.backoff;
  options.growth_interval = c.interval;
  options.max_scale = c.max_scale;
  options.hysteresis = c.hysteresis;

  at::Tensor scale = at::full({1}, c.start);
  at::Tensor growth = at::zeros({1}, at::kInt);
  at::Tensor overflows = at::zeros({1}, at::kInt);
  float gpu_scale = c.start;
  int32_t gpu_growth = 0;
  int32_t gpu_overflows = 0;
  // Overflows alone, in runs of two and three, and long clean stretches.
  const char* pattern = "0010011000111000000100000110";
  for (int step = 0; pattern[step] != '\0'; ++step) {
    CAPTURE(step);
    const float found = pattern[step] == '1' ? 1.f : 0.f;
    REQUIRE_LAUNCH(launch_update_scale(&gpu_scale, &gpu_growth, &gpu_overflows, &found, c.growth,
                                       c.backoff, c.interval, c.max_scale, c.hysteresis, nullptr));
    fusetrain::ops::update_scale_(scale, growth, overflows, at::full({1}, found), options);
    REQUIRE_BITS_EQUAL(at::full({1}, gpu_scale), scale);
    REQUIRE(gpu_growth == growth.item<int32_t>());
    REQUIRE(gpu_overflows == overflows.item<int32_t>());
  }
}
