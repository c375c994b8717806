// Argument checks shared by the op implementations: each message names the
// argument (and the list index) at fault and what was expected.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fusetrain::ops {

/// A one-element tensor of `dtype` (the device-side scalars: scale, found_inf...).
/// Whether an optional tensor argument was given (present and defined).
inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline void check_scalar_tensor(const at::Tensor& t, const char* op, const char* name,
                                at::ScalarType dtype) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.numel() == 1, op, ": ", name, " must hold exactly one element, got shape ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                              const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; move them to one device");
}

/// Every tensor of a list: defined, floating point, on `device`.
inline void check_float_list(at::TensorList tensors, const at::Device& device, const char* op,
                             const char* name) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name, "[", i,
                "] must be a floating point tensor (float32, float16, bfloat16 or float64), got ",
                t.scalar_type());
    TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(),
                " but the others are on ", device, "; group tensors by device first");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, "[", i,
                "] must be a strided tensor; pass a sparse gradient's values()");
  }
}

/// fn(T{}) for the element type T of `dtype` (float, c10::Half or
/// c10::BFloat16): the kernels' dispatch over the floating types they take;
/// any other dtype is an error naming `op`.
template <typename Fn>
auto with_element_type(at::ScalarType dtype, const char* op, const Fn& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(float{});
    case at::kHalf:
      return fn(c10::Half{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

}  // namespace fusetrain::ops
