// Mixed-precision policies and autocast guards over at::autocast's TLS state.
#include <fusetrain/amp/policy.h>
#include <fusetrain/ops/cpu_features.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#ifdef FUSETRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <algorithm>
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
}  // namespace

const std::vector<std::string>& Policy::names() {
  static const std::vector<std::string> kNames = {"float32", "mixed_float16", "mixed_bfloat16",
                                                     "mixed_float8"};
  return kNames;
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
  if (f.amx_bf16 || f.avx512_bf16) {
    Policy p("mixed_bfloat16");
    p.reason_ = cpu + " computes bfloat16 natively (" +
                (f.amx_bf16 ? std::string("AMX-BF16") : std::string("AVX512-BF16")) +
                "): bf16 convolutions and matmuls run faster than float32";
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
