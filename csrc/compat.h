// The C++ differences between the torch releases fusetrain supports (2.11
// through 2.15, _torch_versions.py), each named by the feature it adapts.
// Note [torch compat]: every difference lives here (the Python side's live in
// fusetrain/_compat.py), detected from the API itself (a member that exists, a
// type a function returns) rather than from version numbers, so a nightly or
// a patch release that moves an API is handled by what it is, and a new
// difference is one more entry here, never a check scattered through the code.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

#include <type_traits>
#include <utility>

namespace c10d {  // <torch/csrc/distributed/c10d/ProcessGroup.hpp> where used
class ProcessGroup;
class Work;
}  // namespace c10d

namespace fusetrain::compat {

// ----------------------------------------------- optimizer param-group options
/// Adds `group` to `optimizer` with the group's own options. torch 2.15's
/// Optimizer::add_param_group (which its constructors call too) merges a
/// group's options into the defaults only for torch's own option types
/// (AdamWOptions, SGDOptions, ...) and gives any other optimizer's group the
/// defaults alone, so FusedAdamW's per-group lr and weight decay were lost
/// (since torch 2.12); torch 2.11 kept the group's options whole, as this
/// does on every torch.
inline void add_param_group(torch::optim::Optimizer& optimizer,
                            const torch::optim::OptimizerParamGroup& group) {
  optimizer.add_param_group(group);
  if (group.has_options()) optimizer.param_groups().back().set_options(group.options().clone());
}

// ------------------------------------------------------- autograd node handles
/// The owning handle of an autograd Node (a leaf's gradient accumulator):
/// std::shared_ptr<Node> through torch 2.12, c10::intrusive_ptr<Node> from 2.13.
using NodeHandle =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// ------------------------------------------- single-tensor c10d collectives
namespace detail {
template <typename Group, typename = void>
struct HasSingleCollectives : std::false_type {};
// From torch 2.13 they are named after torchcomms (all_gather_single,
// reduce_scatter_single) and the underscore names are deprecated; 2.11 and
// 2.12 have only those (_allgather_base, _reduce_scatter_base).
template <typename Group>
struct HasSingleCollectives<
    Group, std::void_t<decltype(std::declval<Group&>().all_gather_single(
               std::declval<at::Tensor&>(), std::declval<at::Tensor&>()))>> : std::true_type {};
}  // namespace detail

/// all_gather_into_tensor: `out` holds every rank's `in`, end to end.
template <typename Group = c10d::ProcessGroup>
c10::intrusive_ptr<c10d::Work> all_gather_single(Group& group, at::Tensor& out, at::Tensor& in) {
  if constexpr (detail::HasSingleCollectives<Group>::value) {
    return group.all_gather_single(out, in);
  } else {
    return group._allgather_base(out, in);
  }
}

/// reduce_scatter_tensor (sum): `out` is this rank's piece of the sum of the
/// ranks' `in`, which holds world-size pieces end to end.
template <typename Group = c10d::ProcessGroup>
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(Group& group, at::Tensor& out, at::Tensor& in) {
  if constexpr (detail::HasSingleCollectives<Group>::value) {
    return group.reduce_scatter_single(out, in);
  } else {
    return group._reduce_scatter_base(out, in);
  }
}

}  // namespace fusetrain::compat
