// Mixed-precision policies and autocast guards over at::autocast's TLS state.
#include <fusetrain/amp/policy.h>
#include <fusetrain/ops/cpu/cpu_features.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#ifdef FUSETRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdio>
#include <limits>
#include <mutex>
#include <sstream>

namespace fusetrain::amp {

namespace {
std::mutex g_policy_mutex;
Policy& global_policy_ref() {
  static Policy policy("float32");
  return policy;
}
std::string join(const std::vector<std::string>& items) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? ", " : "") << '"' << items[i] << '"';
  return out.str();
}

// Note [bfloat16 probe]
// AVX512-BF16 alone does not make bf16 the faster precision. Measured on
// 2-vCPU VMs with the same torch: oneDNN's bf16 convolutions ran 2.5x
// float32's speed on an AVX-512 EPYC (Zen 4), but 0.7x (matmuls 0.55x) on a
// Xeon whose VM shows AVX512-BF16 without AMX, where float32 trained the
// default CNN 1.21x faster (2026-12-03). So where the CPU has AVX512-BF16 and
// no AMX-BF16, best_policy measures (measure_cpu_bf16_speed, once per
// process) and takes bf16 where it is kBf16Margin faster: the rest of a bf16
// step (casts, the float32 head) must be paid for too. The probe runs on one
// thread, as each trainer rank does, and alternates the dtypes, keeping each
// one's best time: with two threads on a busy 2-core machine a barrier
// waits for a preempted thread, and one such run read 2.7x where the quiet
// machine reads 0.55x. With AMX bf16 wins outright (1.7x the whole default
// run); without either it is emulated and slower.
constexpr double kBf16Margin = 1.2;

// Restores the intra-op thread count on scope exit.
class ThreadCountGuard {
 public:
  explicit ThreadCountGuard(int threads) : previous_(at::get_num_threads()) {
    at::set_num_threads(threads);
  }
  ~ThreadCountGuard() { at::set_num_threads(previous_); }
  ThreadCountGuard(const ThreadCountGuard&) = delete;
  ThreadCountGuard& operator=(const ThreadCountGuard&) = delete;

 private:
  int previous_;
};

double elapsed_ms(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

double cached_bf16_speed() {
  static const double speed = measure_cpu_bf16_speed();
  return speed;
}
std::string ratio_text(double r) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", r);
  return buf;
}
}  // namespace

const std::vector<std::string>& Policy::names() {
  static const std::vector<std::string> kNames = {"float32", "mixed_float16", "mixed_bfloat16",
                                                     "mixed_float8"};
  return kNames;
}

double measure_cpu_bf16_speed() {
  at::NoGradGuard no_grad;
  // The dtypes below are the probe's, whatever autocast region calls it.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const ThreadCountGuard one_thread(1);
  const at::Tensor x = at::randn({32, 24, 28, 28}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor w = at::randn({24, 24, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor a = at::randn({384, 384});
  const at::Tensor b = at::randn({384, 384});
  struct Operands {
    at::Tensor x, w, a, b;
  };
  const Operands f32{x, w, a, b};
  const Operands bf16{x.to(at::kBFloat16), w.to(at::kBFloat16), a.to(at::kBFloat16),
                      b.to(at::kBFloat16)};
  const auto work = [](const Operands& o) {
    return [&o] {
      at::conv2d(o.x, o.w, {}, 1, 1);
      at::mm(o.a, o.b);
    };
  };
  const auto run_f32 = work(f32), run_bf16 = work(bf16);
  run_f32();  // warm-up: oneDNN builds its kernels on the first call
  run_bf16();
  double best_f32 = std::numeric_limits<double>::infinity(), best_bf16 = best_f32;
  for (int i = 0; i < 7; ++i) {
    best_f32 = std::min(best_f32, elapsed_ms(run_f32));
    best_bf16 = std::min(best_bf16, elapsed_ms(run_bf16));
  }
  return best_f32 / best_bf16;
}

Policy::Policy(const std::string& name) : name_(name) {
  if (name == "auto") {
    *this = best_policy(torch::cuda::is_available() ? c10::DeviceType::CUDA : c10::DeviceType::CPU);
  } else if (name == "float32") {
    compute_dtype_ = at::kFloat;
  } else if (name == "mixed_float16") {
    compute_dtype_ = at::kHalf;
  } else if (name == "mixed_bfloat16" || name == "mixed_float8") {
    compute_dtype_ = at::kBFloat16;
  } else {
    TORCH_CHECK_VALUE(false, "unknown precision policy \"", name, "\"; valid names are ",
                      join(names()), " and \"auto\"");
  }
}

Policy best_policy(c10::DeviceType device_type) {
  if (device_type == c10::DeviceType::CUDA) {
    TORCH_CHECK(torch::cuda::is_available(), "best_policy: no CUDA device is visible");
    const auto dtypes = autocast_dtypes(device_type);
    const bool bf16 = std::find(dtypes.begin(), dtypes.end(), at::kBFloat16) != dtypes.end();
    Policy p(bf16 ? "mixed_bfloat16" : "mixed_float16");
    p.reason_ = bf16 ? "the GPU computes bfloat16 (compute capability 8.0 or newer): no loss "
                       "scaling needed"
                     : "the GPU has no bfloat16 (compute capability below 8.0): float16 with "
                       "loss scaling";
    return p;
  }
  TORCH_CHECK_VALUE(device_type == c10::DeviceType::CPU, "best_policy: no policy for ",
                    c10::DeviceTypeName(device_type, /*lower_case=*/true));
  const ops::CpuFeatures& f = ops::cpu_features();
  const std::string cpu = f.model.empty() ? "this CPU" : f.model;
  if (f.amx_bf16) {
    Policy p("mixed_bfloat16");
    p.reason_ = cpu + " computes bfloat16 natively (AMX-BF16): bf16 convolutions and matmuls run "
                      "faster than float32";
    return p;
  }
  if (f.avx512_bf16) {
    // Note [bfloat16 probe]
    const double speed = cached_bf16_speed();
    const bool bf16 = speed >= kBf16Margin;
    Policy p(bf16 ? "mixed_bfloat16" : "float32");
    p.reason_ = cpu + " has AVX512-BF16 without AMX, and a probe ran bf16 convolutions and "
                      "matmuls at " + ratio_text(speed) + " float32's speed" +
                (bf16 ? "" : " (bf16 needs " + ratio_text(kBf16Margin) + ")");
    return p;
  }
  Policy p("float32");
  p.reason_ = cpu + " has no native bfloat16 (AMX-BF16, AVX512-BF16): bf16 convolutions and "
                    "matmuls would be emulated, slower than float32";
  return p;
}

void set_global_policy(const Policy& policy) {
  const std::lock_guard<std::mutex> lock(g_policy_mutex);
  global_policy_ref() = policy;
}

Policy global_policy() {
  const std::lock_guard<std::mutex> lock(g_policy_mutex);
  return global_policy_ref();
}

std::vector<at::ScalarType> autocast_dtypes(c10::DeviceType device_type) {
  if (device_type == c10::DeviceType::CPU) return {at::kBFloat16, at::kHalf};
  if (device_type == c10::DeviceType::CUDA) {
    if (!torch::cuda::is_available()) return {};
#ifdef FUSETRAIN_WITH_CUDA
    // bf16 needs Ampere (sm_80) or newer.
    if (at::cuda::getCurrentDeviceProperties()->major >= 8) return {at::kHalf, at::kBFloat16};
#endif
    return {at::kHalf};
  }
  return {};
}

AutocastGuard::AutocastGuard(c10::DeviceType device_type, const Policy& policy)
    : device_type_(device_type),
      prev_enabled_(at::autocast::is_autocast_enabled(device_type)),
      prev_dtype_(at::autocast::get_autocast_dtype(device_type)) {
  if (policy.is_mixed()) {
    const auto dtypes = autocast_dtypes(device_type);
    TORCH_CHECK(std::find(dtypes.begin(), dtypes.end(), policy.compute_dtype()) != dtypes.end(),
                "policy \"", policy.name(), "\" needs autocast to ", policy.compute_dtype(),
                " on ", c10::DeviceTypeName(device_type, /*lower_case=*/true),
                ", which this build or device does not support",
                device_type == c10::DeviceType::CUDA && !torch::cuda::is_available()
                    ? " (CUDA is not available)"
                    : "");
    at::autocast::set_autocast_dtype(device_type, policy.compute_dtype());
  }
  at::autocast::set_autocast_enabled(device_type, policy.is_mixed());
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // Leaving the outermost region drops the cast cache, as torch.autocast does.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
}

Float32Guard::Float32Guard()
    : prev_cpu_(at::autocast::is_autocast_enabled(c10::DeviceType::CPU)),
      prev_cuda_(at::autocast::is_autocast_enabled(c10::DeviceType::CUDA)) {
  at::autocast::set_autocast_enabled(c10::DeviceType::CPU, false);
  at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, false);
}

Float32Guard::~Float32Guard() {
  at::autocast::set_autocast_enabled(c10::DeviceType::CPU, prev_cpu_);
  at::autocast::set_autocast_enabled(c10::DeviceType::CUDA, prev_cuda_);
}

}  // namespace fusetrain::amp
