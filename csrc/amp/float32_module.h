// Float32 islands for C++ models: the Keras `dtype="float32"` layer argument.
#pragma once

#include <fusetrain/amp/policy.h>

#include <torch/nn/module.h>

#include <type_traits>
#include <utility>

namespace fusetrain::amp {

namespace detail {
inline at::Tensor tensor_to_float32(const at::Tensor& t) {
  return t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kFloat
             ? t.to(at::kFloat)
             : t;
}
// One template for every argument: an overload for `const at::Tensor&` next
// to a forwarding template would lose to it for rvalue and non-const tensors.
template <typename T>
decltype(auto) to_float32(T&& value) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return tensor_to_float32(value);
  } else {
    return std::forward<T>(value);
  }
}
}  // namespace detail

/// Runs the wrapped module in float32 inside an autocast region: autocast is
/// off within its forward and floating tensor arguments are cast to float32.
/// The wrapped module's parameters, buffers and children are registered under
/// their own names, so state-dict keys do not change.
///
///   head = register_module("head", fusetrain::amp::keep_float32(torch::nn::Linear(64, 10)));
///   auto logits = head->forward(x);  // float32 under an AutocastGuard
template <typename Holder>
class Float32Impl : public torch::nn::Module {
 public:
  explicit Float32Impl(Holder inner) : inner_(std::move(inner)) {
    for (const auto& p : inner_->named_parameters(/*recurse=*/false)) {
      register_parameter(p.key(), p.value(), p.value().requires_grad());
    }
    for (const auto& b : inner_->named_buffers(/*recurse=*/false)) {
      register_buffer(b.key(), b.value());
    }
    for (const auto& c : inner_->named_children()) register_module(c.key(), c.value());
  }

  template <typename... Args>
  auto forward(Args&&... args) {
    const Float32Guard guard;
    return inner_->forward(detail::to_float32(std::forward<Args>(args))...);
  }

  Holder& inner() { return inner_; }

 private:
  Holder inner_;
};

template <typename Holder>
std::shared_ptr<Float32Impl<Holder>> keep_float32(Holder inner) {
  return std::make_shared<Float32Impl<Holder>>(std::move(inner));
}

}  // namespace fusetrain::amp
