// Mixed-precision policies (Keras' names) and the RAII autocast guards.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace fusetrain::amp {

/// What a model computes in and keeps its variables in:
///   "float32"          compute float32, variables float32
///   "mixed_float16"    compute float16, variables float32 (use a GradScaler)
///   "mixed_bfloat16"   compute bfloat16, variables float32
///   "mixed_float8"     mixed_bfloat16, plus float8 GEMMs in the large linear
///                      layers of models built for it (amp::Float8Linear)
///   "auto"             best_policy() of the default device (CUDA when one
///                      is visible, else the CPU), resolved at construction
class Policy {
 public:
  /// Throws c10::Error (ValueError in Python) listing the valid names.
  explicit Policy(const std::string& name = "float32");

  /// One of the concrete names ("auto" has been resolved).
  const std::string& name() const { return name_; }
  /// Why "auto" chose this policy; empty for a policy named directly.
  const std::string& reason() const { return reason_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  at::ScalarType variable_dtype() const { return at::kFloat; }
  /// True unless the policy is "float32".
  bool is_mixed() const { return compute_dtype_ != at::kFloat; }
  /// True for "mixed_float8".
  bool is_float8() const { return name_ == "mixed_float8"; }

  /// The concrete names; "auto" is accepted besides them.
  static const std::vector<std::string>& names();

  bool operator==(const Policy& other) const { return name_ == other.name_; }
  bool operator!=(const Policy& other) const { return !(*this == other); }

 private:
  friend Policy best_policy(c10::DeviceType device_type);
  std::string name_;
  std::string reason_;
  at::ScalarType compute_dtype_;
};

/// The policy that trains fastest on `device_type` at float32's accuracy, with
/// its reason():
///   CUDA: mixed_bfloat16 where the GPU computes bfloat16 (compute capability
///         8.0 or newer), else mixed_float16;
///   CPU:  mixed_bfloat16 with AMX-BF16; with AVX512-BF16 alone, where a
///         probe (measure_cpu_bf16_speed, once per process) runs bf16 at
///         least 1.2x faster than float32,
///         else float32 (Note [bfloat16 probe] in policy.cpp); float32
///         without either (bf16 is emulated and slower there).
Policy best_policy(c10::DeviceType device_type);

/// float32 time / bfloat16 time of a 3x3 convolution and a matmul of the
/// default CNN's sizes on one thread, best of 7 each, interleaved (Note
/// [bfloat16 probe] in policy.cpp): what best_policy(CPU) measures once on
/// CPUs with AVX512-BF16 and no AMX-BF16. Measures afresh on every call
/// (about 0.1 s); restores the intra-op thread count.
double measure_cpu_bf16_speed();

/// The process-wide default policy ("float32" until set).
void set_global_policy(const Policy& policy);
Policy global_policy();

/// Enables autocast for `device_type` in the policy's compute dtype for its
/// lifetime (a "float32" policy disables it), then restores the previous
/// state. A policy the device cannot autocast to is an error, never a silent
/// fall-back to float32.
class AutocastGuard {
 public:
  explicit AutocastGuard(c10::DeviceType device_type, const Policy& policy = global_policy());
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_type_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
};

/// Turns autocast off on every device for its lifetime: a float32 island.
class Float32Guard {
 public:
  Float32Guard();
  ~Float32Guard();
  Float32Guard(const Float32Guard&) = delete;
  Float32Guard& operator=(const Float32Guard&) = delete;

 private:
  bool prev_cpu_;
  bool prev_cuda_;
};

/// The autocast dtypes torch supports on `device_type` ("cpu": bf16, fp16;
/// "cuda": fp16, plus bf16 where the GPU has it).
std::vector<at::ScalarType> autocast_dtypes(c10::DeviceType device_type);

}  // namespace fusetrain::amp
