#include <fusetrain/optim/zero.h>

#include <fusetrain/dist/ddp.h>
#include <fusetrain/ops/amp.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <unordered_map>

namespace fusetrain::optim {

namespace {

using torch::optim::OptimizerParamGroup;
using torch::optim::OptimizerParamState;

bool is_16bit(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

at::Device collective_device(const at::Tensor& any) {
  return any.is_cuda() ? any.device() : at::Device(at::kCPU);
}

// The state fields of the two local optimizers, by name, for consolidation.
struct Field {
  const char* name;
  at::Tensor (*get)(const OptimizerParamState&);
  void (*set)(OptimizerParamState&, at::Tensor);
};

const std::vector<Field>& adamw_fields() {
  using S = FusedAdamWParamState;
  static const std::vector<Field> fields{
      {"exp_avg", [](const OptimizerParamState& s) { return static_cast<const S&>(s).exp_avg(); },
       [](OptimizerParamState& s, at::Tensor t) { static_cast<S&>(s).exp_avg(std::move(t)); }},
      {"exp_avg_sq",
       [](const OptimizerParamState& s) { return static_cast<const S&>(s).exp_avg_sq(); },
       [](OptimizerParamState& s, at::Tensor t) { static_cast<S&>(s).exp_avg_sq(std::move(t)); }},
      {"max_exp_avg_sq",
       [](const OptimizerParamState& s) { return static_cast<const S&>(s).max_exp_avg_sq(); },
       [](OptimizerParamState& s, at::Tensor t) {
         static_cast<S&>(s).max_exp_avg_sq(std::move(t));
       }},
      {"master_param",
       [](const OptimizerParamState& s) { return static_cast<const S&>(s).master_param(); },
       [](OptimizerParamState& s, at::Tensor t) { static_cast<S&>(s).master_param(std::move(t)); }},
  };
  return fields;
}

const std::vector<Field>& sgd_fields() {
  using S = FusedSGDParamState;
  static const std::vector<Field> fields{
      {"momentum_buffer",
       [](const OptimizerParamState& s) { return static_cast<const S&>(s).momentum_buffer(); },
       [](OptimizerParamState& s, at::Tensor t) {
         static_cast<S&>(s).momentum_buffer(std::move(t));
       }},
      {"master_param",
       [](const OptimizerParamState& s) { return static_cast<const S&>(s).master_param(); },
       [](OptimizerParamState& s, at::Tensor t) { static_cast<S&>(s).master_param(std::move(t)); }},
  };
  return fields;
}

bool group_uses_master(const OptimizerParamGroup& group) {
  if (const auto* o = dynamic_cast<const FusedAdamWOptions*>(&group.options())) {
    return o->master_weights();
  }
  if (const auto* o = dynamic_cast<const FusedSGDOptions*>(&group.options())) {
    return o->master_weights();
  }
  return false;
}

std::vector<std::vector<size_t>> stage1_buckets(const std::vector<at::Tensor>& params,
                                                double cap_mb) {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto cap = static_cast<size_t>(cap_mb * (1 << 20));
  return dist::compute_bucket_assignment(params, cap, cap, order);
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    std::vector<OptimizerParamGroup> param_groups,
    std::unique_ptr<torch::optim::OptimizerOptions> defaults, LocalFactory make_local,
    c10::intrusive_ptr<c10d::ProcessGroup> group, ZeroOptions options,
    dist::Reducer* reducer)
    : FusedOptimizer(std::move(param_groups), std::move(defaults)),
      group_(std::move(group)),
      options_(options),
      reducer_(reducer) {
  TORCH_CHECK_VALUE(group_, "ZeroRedundancyOptimizer: no process group");
  TORCH_CHECK_VALUE(options_.max_grad_norm() >= 0, "ZeroRedundancyOptimizer: max_grad_norm must "
                    "be >= 0 (0: off), got ", options_.max_grad_norm());
  for (const auto& g : this->param_groups()) {
    for (const auto& p : g.params()) all_params_.push_back(p);
  }
  TORCH_CHECK_VALUE(!all_params_.empty(), "ZeroRedundancyOptimizer: no parameters");
  // Every rank must be in the same stage.
  {
    std::vector<at::Tensor> flag{
        at::full({1}, reducer_ != nullptr ? 1 : 0, at::TensorOptions().dtype(at::kInt))
            .to(collective_device(all_params_.front()))};
    group_->allreduce(flag)->wait();
    const int stage2 = flag[0].to(at::kCPU).item<int>();
    TORCH_CHECK_VALUE(stage2 == 0 || stage2 == group_->getSize(),
                      "ZeroRedundancyOptimizer: gradients are sharded (stage 2) on ", stage2, " of ",
                      group_->getSize(), " ranks, this one (", group_->getRank(), ") ",
                      reducer_ != nullptr ? "included" : "not included",
                      "; every rank must shard alike");
  }
  std::vector<at::Tensor> layout_params;
  std::vector<std::vector<size_t>> buckets;
  std::unordered_map<c10::TensorImpl*, size_t> position;
  if (reducer_ != nullptr) {
    TORCH_CHECK_VALUE(reducer_->shard_gradients(), "ZeroRedundancyOptimizer: the reducer given "
                      "for stage 2 does not shard gradients (DDPOptions::shard_gradients)");
    TORCH_CHECK_VALUE(reducer_->process_group().get() == group_.get(), "ZeroRedundancyOptimizer: "
                      "the reducer's process group is not this optimizer's");
    layout_params = reducer_->parameters();
    buckets = reducer_->bucket_indices();
  } else {
    layout_params = all_params_;
    buckets = stage1_buckets(all_params_, options_.bucket_cap_mb());
  }
  for (size_t i = 0; i < layout_params.size(); ++i) {
    position[layout_params[i].unsafeGetTensorImpl()] = i;
  }
  TORCH_CHECK_VALUE(position.size() == all_params_.size(), "ZeroRedundancyOptimizer: the "
                    "stage-2 reducer holds ", position.size(), " parameters, this optimizer ",
                    all_params_.size(), "; they must be the same");
  std::unordered_map<c10::TensorImpl*, size_t> group_of;
  for (size_t g = 0; g < this->param_groups().size(); ++g) {
    for (const auto& p : this->param_groups()[g].params()) {
      const auto it = position.find(p.unsafeGetTensorImpl());
      TORCH_CHECK_VALUE(it != position.end(), "ZeroRedundancyOptimizer: a parameter of group ", g,
                        " is not among the stage-2 reducer's parameters");
      layout_index_.push_back(it->second);
      group_of[p.unsafeGetTensorImpl()] = g;
    }
  }
  shards_ = std::make_unique<dist::ShardedParameters>(layout_params, std::move(buckets), group_,
                                                      options_.parameters_as_bucket_view());
  std::vector<std::vector<at::Tensor>> per_group(this->param_groups().size());
  const auto& views = shards_->param_slices();
  for (size_t k = 0; k < views.size(); ++k) {
    const size_t g = group_of.at(layout_params[shards_->slices()[k].param].unsafeGetTensorImpl());
    slice_group_.push_back(g);
    per_group[g].push_back(views[k]);
  }
  std::vector<OptimizerParamGroup> local_groups;
  for (size_t g = 0; g < per_group.size(); ++g) {
    if (per_group[g].empty()) continue;
    local_groups_.push_back(g);
    local_groups.emplace_back(per_group[g], this->param_groups()[g].options().clone());
  }
  // A rank that owns no element (more ranks than elements) steps nothing.
  if (!local_groups.empty()) {
    local_ = make_local(std::move(local_groups));
    TORCH_CHECK_VALUE(dynamic_cast<FusedAdamW*>(local_.get()) != nullptr ||
                          dynamic_cast<FusedSGD*>(local_.get()) != nullptr,
                      "ZeroRedundancyOptimizer: the local optimizer must be a FusedAdamW or a "
                      "FusedSGD (its state is consolidated field by field)");
    TORCH_CHECK_VALUE((dynamic_cast<FusedAdamW*>(local_.get()) != nullptr) == is_adamw(),
                      "ZeroRedundancyOptimizer: the defaults are not the local optimizer's options");
  }
}

std::unique_ptr<ZeroRedundancyOptimizer> ZeroRedundancyOptimizer::adamw(
    std::vector<OptimizerParamGroup> param_groups, FusedAdamWOptions defaults,
    c10::intrusive_ptr<c10d::ProcessGroup> group, ZeroOptions options,
    dist::Reducer* reducer) {
  auto make = [defaults](std::vector<OptimizerParamGroup> groups) -> std::unique_ptr<FusedOptimizer> {
    return std::make_unique<FusedAdamW>(std::move(groups), defaults);
  };
  return std::make_unique<ZeroRedundancyOptimizer>(
      std::move(param_groups), std::make_unique<FusedAdamWOptions>(defaults), make,
      std::move(group), options, reducer);
}

std::unique_ptr<ZeroRedundancyOptimizer> ZeroRedundancyOptimizer::sgd(
    std::vector<OptimizerParamGroup> param_groups, FusedSGDOptions defaults,
    c10::intrusive_ptr<c10d::ProcessGroup> group, ZeroOptions options,
    dist::Reducer* reducer) {
  auto make = [defaults](std::vector<OptimizerParamGroup> groups) -> std::unique_ptr<FusedOptimizer> {
    return std::make_unique<FusedSGD>(std::move(groups), defaults);
  };
  return std::make_unique<ZeroRedundancyOptimizer>(
      std::move(param_groups), std::make_unique<FusedSGDOptions>(defaults), make,
      std::move(group), options, reducer);
}

bool ZeroRedundancyOptimizer::is_adamw() const {
  return dynamic_cast<const FusedAdamWOptions*>(&defaults()) != nullptr;
}

std::vector<at::Tensor> ZeroRedundancyOptimizer::grad_slices() const {
  return reducer_ != nullptr
             ? shards_->slices_of_pieces(reducer_->grad_pieces(), reducer_->has_gradient())
             : shards_->grad_slices();
}

void ZeroRedundancyOptimizer::sync_options() {
  if (!local_) return;
  for (size_t k = 0; k < local_groups_.size(); ++k) {
    local_->param_groups()[k].set_options(param_groups()[local_groups_[k]].options().clone());
  }
}

void ZeroRedundancyOptimizer::set_amp_scaling(std::optional<at::Tensor> grad_scale,
                                              std::optional<at::Tensor> found_inf) {
  grad_scale_ = std::move(grad_scale);
  found_inf_ = std::move(found_inf);
}

void ZeroRedundancyOptimizer::set_lr_tensor(std::optional<at::Tensor> lr) {
  if (local_) local_->set_lr_tensor(lr);
  FusedOptimizer::set_lr_tensor(std::move(lr));
}

std::optional<std::vector<at::Tensor>> ZeroRedundancyOptimizer::amp_gradients() {
  if (reducer_ == nullptr) return std::nullopt;
  std::vector<at::Tensor> grads = grad_slices();
  grads.push_back(shards_->any_non_finite(grads));
  return grads;
}

at::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> grads = grad_slices();
  const auto& views = shards_->param_slices();
  for (size_t k = 0; k < views.size(); ++k) {
    at::Tensor view = views[k];
    view.mutable_grad() = grads[k];
  }
  std::optional<at::Tensor> scale = grad_scale_;
  if (options_.max_grad_norm() > 0) {
    // As one clips unsharded gradients (GradScaler::unscale_, then
    // multiply by the clip coefficient), on the shards: the same bits but
    // for the norm's summation order. On the device, no host sync.
    std::vector<at::Tensor> present;
    for (const auto& g : grads) {
      if (g.defined()) present.push_back(g);
    }
    if (scale && !present.empty()) {
      const at::Tensor inv = scale->to(at::kDouble).reciprocal().to(at::kFloat);
      at::Tensor ignored = at::zeros({}, inv.options());  // found_inf came with the scale
      std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
      for (const auto& g : present) by_dtype[g.scalar_type()].push_back(g);
      for (auto& [dtype, list] : by_dtype) {
        ops::non_finite_check_and_unscale_(list, ignored, inv.to(list.front().device()));
      }
    }
    scale.reset();
    const at::Tensor norm = shards_->global_norm(present);
    last_grad_norm_ = norm;
    const at::Tensor coef = (options_.max_grad_norm() / (norm + 1e-6)).clamp_max(1.0);
    for (auto& g : present) g.mul_(coef.to(g.device()));
  }
  if (local_) {
    sync_options();
    local_->set_amp_scaling(scale, found_inf_);
    try {
      local_->step();
    } catch (...) {
      local_->set_amp_scaling(std::nullopt, std::nullopt);
      throw;
    }
    local_->set_amp_scaling(std::nullopt, std::nullopt);
  }
  // The slices let go of the gradients (zero_grad must be able to free
  // them); stage 2's pieces are consumed: the next backward overwrites them.
  for (size_t k = 0; k < views.size(); ++k) {
    at::Tensor view = views[k];
    view.mutable_grad().reset();
  }
  if (reducer_ != nullptr) reducer_->zero_grad_pieces();
  shards_->all_gather_params();
  return loss;
}

void ZeroRedundancyOptimizer::consolidate_state(int to) {
  at::NoGradGuard no_grad;
  const auto& params = shards_->params();
  const auto& slices = shards_->slices();
  const auto& views = shards_->param_slices();
  const auto& fields = is_adamw() ? adamw_fields() : sgd_fields();
  auto* local_state = local_ ? &local_->state() : nullptr;
  auto state_of = [&](size_t k) -> const OptimizerParamState* {
    if (!local_state) return nullptr;
    const auto it = local_state->find(views[k].unsafeGetTensorImpl());
    return it == local_state->end() ? nullptr : it->second.get();
  };
  // Step counts (AdamW): any owner's (the owners of a parameter agree).
  const at::Device dev = collective_device(params.front());
  at::Tensor steps = at::full({static_cast<int64_t>(params.size())}, -1.0, at::kDouble);
  if (is_adamw()) {
    std::vector<int64_t> owned;
    std::vector<at::Tensor> counts;
    for (size_t k = 0; k < slices.size(); ++k) {
      const auto* s = state_of(k);
      if (s == nullptr) continue;
      const at::Tensor& step = static_cast<const FusedAdamWParamState&>(*s).step();
      if (!step.defined()) continue;
      owned.push_back(static_cast<int64_t>(slices[k].param));
      counts.push_back(step.reshape({}).to(at::kDouble));
    }
    if (!owned.empty()) {  // one read from the device, not one per slice
      steps.index_put_({at::tensor(owned, at::kLong)}, at::stack(counts).to(at::kCPU));
    }
    std::vector<at::Tensor> t{steps.to(dev)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    group_->allreduce(t, opts)->wait();
    steps = t[0].to(at::kCPU);
  }
  bool any_double = false;
  for (const auto& p : params) any_double = any_double || p.scalar_type() == at::kDouble;
  const at::ScalarType wire = any_double ? at::kDouble : at::kFloat;  // exact for every dtype
  std::vector<std::map<std::string, at::Tensor>> full(params.size());
  for (const Field& f : fields) {
    std::vector<at::Tensor> per_slice(slices.size());
    for (size_t k = 0; k < slices.size(); ++k) {
      if (const auto* s = state_of(k)) per_slice[k] = f.get(*s);
    }
    std::vector<at::Tensor> gathered = shards_->gather(per_slice, wire, to);
    for (size_t i = 0; i < gathered.size(); ++i) {
      if (gathered[i].defined()) full[i][f.name] = std::move(gathered[i]);
    }
  }
  state().clear();
  if (to >= 0 && to != group_->getRank()) return;
  // The group each parameter is in, for the dtype of its moments.
  std::unordered_map<c10::TensorImpl*, bool> master_of;
  for (const auto& g : param_groups()) {
    for (const auto& p : g.params()) master_of[p.unsafeGetTensorImpl()] = group_uses_master(g);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (full[i].empty()) continue;
    const at::Tensor& p = params[i];
    const bool master = master_of[p.unsafeGetTensorImpl()] && is_16bit(p);
    std::unique_ptr<OptimizerParamState> s;
    if (is_adamw()) {
      auto a = std::make_unique<FusedAdamWParamState>();
      a->step(at::full({}, steps[static_cast<int64_t>(i)].item<double>(),
                       at::TensorOptions().dtype(at::kFloat).device(p.device())));
      s = std::move(a);
    } else {
      s = std::make_unique<FusedSGDParamState>();
    }
    for (const Field& f : fields) {
      const auto it = full[i].find(f.name);
      if (it == full[i].end()) continue;
      const bool fp32 = master || std::string(f.name) == "master_param";
      f.set(*s, it->second.to(fp32 ? at::kFloat : p.scalar_type()));
    }
    state()[p.unsafeGetTensorImpl()] = std::move(s);
  }
}

void ZeroRedundancyOptimizer::shard_state() {
  at::NoGradGuard no_grad;
  const auto& params = shards_->params();
  const auto& slices = shards_->slices();
  const auto& views = shards_->param_slices();
  const auto& fields = is_adamw() ? adamw_fields() : sgd_fields();
  if (local_) {
    auto& local_state = local_->state();
    local_state.clear();
    for (size_t k = 0; k < slices.size(); ++k) {
      const at::Tensor& p = params[slices[k].param];
      const auto it = state().find(p.unsafeGetTensorImpl());
      if (it == state().end()) continue;
      const OptimizerParamState& src = *it->second;
      std::unique_ptr<OptimizerParamState> s;
      if (is_adamw()) {
        auto a = std::make_unique<FusedAdamWParamState>();
        const at::Tensor& step = static_cast<const FusedAdamWParamState&>(src).step();
        if (step.defined()) a->step(step.to(p.device(), at::kFloat, false, /*copy=*/true));
        s = std::move(a);
      } else {
        s = std::make_unique<FusedSGDParamState>();
      }
      for (const Field& f : fields) {
        const at::Tensor t = f.get(src);
        if (!t.defined()) continue;
        TORCH_CHECK_VALUE(t.numel() == p.numel(), "ZeroRedundancyOptimizer: state \"", f.name,
                          "\" of parameter ", slices[k].param, " has ", t.numel(),
                          " elements, the parameter ", p.numel());
        f.set(*s, t.reshape(-1).narrow(0, slices[k].begin, slices[k].length).to(p.device()).clone());
      }
      local_state[views[k].unsafeGetTensorImpl()] = std::move(s);
    }
  }
  state().clear();
}

int64_t ZeroRedundancyOptimizer::local_state_bytes() const {
  if (!local_) return 0;
  int64_t total = 0;
  const auto& fields = is_adamw() ? adamw_fields() : sgd_fields();
  for (const auto& item : local_->state()) {
    for (const Field& f : fields) {
      const at::Tensor t = f.get(*item.second);
      if (t.defined()) total += t.numel() * static_cast<int64_t>(t.element_size());
    }
  }
  return total;
}

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "ZeroRedundancyOptimizer::save: the state is spread over the ranks; call "
              "consolidate_state(0) on every rank and save state() on rank 0 (the format of "
              "FusedAdamW/FusedSGD over the whole parameters)");
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "ZeroRedundancyOptimizer::load: fill state() with the unsharded state on "
              "every rank and call shard_state()");
}

}  // namespace fusetrain::optim
