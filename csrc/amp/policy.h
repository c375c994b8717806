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
class Policy {
 public:
  /// Throws c10::Error (ValueError in Python) listing the valid names.
  explicit Policy(const std::string& name = "float32");

  const std::string& name() const { return name_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  at::ScalarType variable_dtype() const { return at::kFloat; }
  /// True unless the policy is "float32".
  bool is_mixed() const { return compute_dtype_ != at::kFloat; }

  static const std::vector<std::string>& names();

  bool operator==(const Policy& other) const { return name_ == other.name_; }
  bool operator!=(const Policy& other) const { return !(*this == other); }

 private:
  std::string name_;
  at::ScalarType compute_dtype_;
};

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
