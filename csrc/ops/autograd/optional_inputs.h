// Optional tensor arguments of the C++ autograd Functions in this folder.
//
// Note [Optional inputs of C++ autograd Functions]
// Function::apply takes an absent tensor as std::optional (an undefined
// at::Tensor argument fails in torch's bookkeeping of the inputs), and then
// the absent ones have no edge: ctx->needs_input_grad(k) counts only the
// tensors given, in argument order. An optional argument given but
// undefined (None from C++) is absent too: `present` makes it std::nullopt.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fusetrain::ops::autograd {

/// The saved (possibly undefined) tensor as an op's optional argument.
inline std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

/// An optional argument, std::nullopt where absent or undefined.
inline std::optional<at::Tensor> present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t : std::nullopt;
}

}  // namespace fusetrain::ops::autograd
