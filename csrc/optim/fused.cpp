// FusedAdamW and FusedSGD for LibTorch over the fused_adamw_ / fused_sgd_ ops.
#include <fusetrain/optim/fused.h>

#include <fusetrain/compat.h>
#include <fusetrain/ops/optim.h>

#include <torch/optim/serialize.h>

#include <map>
#include <utility>

namespace fusetrain::optim {

namespace {

bool uses_master(bool master_weights, const at::Tensor& p) {
  return master_weights && (p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16);
}

/// Parameters with a gradient, bucketed by (device, dtype, master weights):
/// each bucket is one fused launch.
using BucketKey = std::tuple<std::string, at::ScalarType, bool>;
std::map<BucketKey, std::vector<at::Tensor>> buckets_of(
    const torch::optim::OptimizerParamGroup& group, bool master_weights, const char* name) {
  std::map<BucketKey, std::vector<at::Tensor>> buckets;
  for (const auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    TORCH_CHECK(!p.grad().is_sparse(), name, " does not support sparse gradients");
    buckets[{p.device().str(), p.scalar_type(), uses_master(master_weights, p)}].push_back(p);
  }
  return buckets;
}

std::optional<at::Tensor> on_device(const std::optional<at::Tensor>& t, const at::Device& d) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->to(d, /*non_blocking=*/true);
}

/// p.grad() laid out like p: the kernels walk both in memory order, so a
/// gradient assigned by hand in another layout is copied into p's.
at::Tensor grad_of(const at::Tensor& p) {
  const at::Tensor& g = p.grad();
  if (g.strides() == p.strides()) return g;
  return at::empty_like(p, at::MemoryFormat::Preserve).copy_(g);
}

/// After a step with a grad_scale the kernels have unscaled `grads` in place
/// (Note [Unscaled gradients after a fused step]); a gradient grad_of copied
/// gets the result back.
void write_back(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].is_same(params[i].grad())) params[i].mutable_grad().copy_(grads[i]);
  }
}

at::Tensor run_closure(torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace

// ---------------------------------------------------------- FusedOptimizer

FusedOptimizer::FusedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                               std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{}, std::move(defaults)) {
  for (const auto& group : param_groups) add_param_group(group);
}

FusedOptimizer::FusedOptimizer(std::vector<at::Tensor> params,
                               std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(std::move(params), std::move(defaults)) {}

void FusedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  compat::add_param_group(*this, param_group);
}

void FusedOptimizer::set_amp_scaling(std::optional<at::Tensor> grad_scale,
                                     std::optional<at::Tensor> found_inf) {
  grad_scale_ = std::move(grad_scale);
  found_inf_ = std::move(found_inf);
}

void FusedOptimizer::set_lr_tensor(std::optional<at::Tensor> lr) {
  if (!lr.has_value() || !lr->defined()) {
    lr_tensor_.reset();
    return;
  }
  TORCH_CHECK_VALUE(lr->numel() == 1,
                    "set_lr_tensor: the lr tensor must hold one element, got shape ", lr->sizes());
  TORCH_CHECK_VALUE(lr->scalar_type() == at::kDouble || lr->scalar_type() == at::kFloat,
                    "set_lr_tensor: the lr tensor must be float64 or float32, got ",
                    lr->scalar_type());
  lr_tensor_ = lr->reshape({});
}

FusedOptimizer::DeviceScalars FusedOptimizer::scalars_on(const at::Device& device) const {
  return {on_device(grad_scale_, device), on_device(found_inf_, device),
          on_device(lr_tensor_, device)};
}

// ------------------------------------------------------------------ AdamW

FusedAdamWOptions::FusedAdamWOptions(double lr) : lr_(lr) {}

void FusedAdamWOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedAdamWOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decoupled_weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedAdamWParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void FusedAdamWParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, max_exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

FusedAdamW::FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                       FusedAdamWOptions defaults)
    : FusedOptimizer(std::move(param_groups), std::make_unique<FusedAdamWOptions>(defaults)) {
  TORCH_CHECK_VALUE(defaults.lr() >= 0, "FusedAdamW: invalid learning rate: ", defaults.lr());
  TORCH_CHECK_VALUE(defaults.eps() >= 0, "FusedAdamW: invalid epsilon value: ", defaults.eps());
  const auto [beta1, beta2] = defaults.betas();
  TORCH_CHECK_VALUE(0 <= beta1 && beta1 < 1, "FusedAdamW: invalid beta parameter at index 0: ",
                    beta1);
  TORCH_CHECK_VALUE(0 <= beta2 && beta2 < 1, "FusedAdamW: invalid beta parameter at index 1: ",
                    beta2);
  TORCH_CHECK_VALUE(defaults.weight_decay() >= 0, "FusedAdamW: invalid weight_decay value: ",
                    defaults.weight_decay());
}

at::Tensor FusedAdamW::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const FusedAdamWOptions&>(group.options());
    for (auto& [key, params] : buckets_of(group, o.master_weights(), "FusedAdamW")) {
      const bool master = std::get<2>(key);
      std::vector<at::Tensor> grads, exp_avgs, exp_avg_sqs, max_sqs, masters, steps;
      for (const auto& p : params) {
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto s = std::make_unique<FusedAdamWParamState>();
          const auto state_opts = master ? p.options().dtype(at::kFloat) : p.options();
          s->step(at::zeros({}, p.options().dtype(at::kFloat)));
          s->exp_avg(at::zeros_like(p, state_opts, at::MemoryFormat::Preserve));
          s->exp_avg_sq(at::zeros_like(p, state_opts, at::MemoryFormat::Preserve));
          if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, state_opts, at::MemoryFormat::Preserve));
          if (master) s->master_param(p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
          slot = std::move(s);
        }
        auto& s = static_cast<FusedAdamWParamState&>(*slot);
        grads.push_back(grad_of(p));
        exp_avgs.push_back(s.exp_avg());
        exp_avg_sqs.push_back(s.exp_avg_sq());
        if (o.amsgrad()) max_sqs.push_back(s.max_exp_avg_sq());
        if (master) masters.push_back(s.master_param());
        steps.push_back(s.step());
      }
      ops::AdamHyper h;
      h.lr = o.lr();
      std::tie(h.beta1, h.beta2) = o.betas();
      h.weight_decay = o.weight_decay();
      h.eps = o.eps();
      h.amsgrad = o.amsgrad();
      h.maximize = o.maximize();
      h.decoupled_weight_decay = o.decoupled_weight_decay();
      const DeviceScalars d = scalars_on(params[0].device());
      ops::fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_sqs, masters, steps, h,
                        d.grad_scale, d.found_inf, d.lr);
      if (d.grad_scale && d.grad_scale->defined()) write_back(params, grads);
    }
  }
  return loss;
}

void FusedAdamW::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<FusedAdamWParamState, FusedAdamWOptions>(archive, *this);
}

void FusedAdamW::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<FusedAdamWParamState, FusedAdamWOptions>(archive, *this);
}

// -------------------------------------------------------------------- SGD

FusedSGDOptions::FusedSGDOptions(double lr) : lr_(lr) {}

void FusedSGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedSGDOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedSGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void FusedSGDParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

FusedSGD::FusedSGD(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                   FusedSGDOptions defaults)
    : FusedOptimizer(std::move(param_groups), std::make_unique<FusedSGDOptions>(defaults)) {
  TORCH_CHECK_VALUE(defaults.lr() >= 0, "FusedSGD: invalid learning rate: ", defaults.lr());
  TORCH_CHECK_VALUE(defaults.momentum() >= 0, "FusedSGD: invalid momentum value: ",
                    defaults.momentum());
  TORCH_CHECK_VALUE(defaults.weight_decay() >= 0, "FusedSGD: invalid weight_decay value: ",
                    defaults.weight_decay());
  TORCH_CHECK_VALUE(!defaults.nesterov() || (defaults.momentum() > 0 && defaults.dampening() == 0),
                    "FusedSGD: Nesterov momentum requires a momentum and zero dampening");
}

at::Tensor FusedSGD::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const FusedSGDOptions&>(group.options());
    for (auto& [key, params] : buckets_of(group, o.master_weights(), "FusedSGD")) {
      const bool master = std::get<2>(key);
      // Parameters whose momentum buffer starts now take it from their
      // gradient (torch's first-step clone): a launch of their own.
      std::vector<at::Tensor> fresh, running;
      for (const auto& p : params) {
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto s = std::make_unique<FusedSGDParamState>();
          if (master) s->master_param(p.detach().to(at::kFloat, false, true));
          slot = std::move(s);
        }
        auto& s = static_cast<FusedSGDParamState&>(*slot);
        const bool starts = o.momentum() != 0 && !s.momentum_buffer().defined();
        if (starts) {
          s.momentum_buffer(at::zeros_like(p, master ? p.options().dtype(at::kFloat) : p.options(),
                                           at::MemoryFormat::Preserve));
        }
        (starts ? fresh : running).push_back(p);
      }
      ops::SgdHyper h{o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov(),
                      o.maximize()};
      const DeviceScalars d = scalars_on(params[0].device());
      for (const auto& [subset, first] :
           {std::pair<const std::vector<at::Tensor>&, bool>{fresh, true}, {running, false}}) {
        if (subset.empty()) continue;
        std::vector<at::Tensor> grads, bufs, masters;
        for (const auto& p : subset) {
          auto& s = static_cast<FusedSGDParamState&>(*state_[p.unsafeGetTensorImpl()]);
          grads.push_back(grad_of(p));
          if (o.momentum() != 0) bufs.push_back(s.momentum_buffer());
          if (master) masters.push_back(s.master_param());
        }
        ops::fused_sgd_(subset, grads, bufs, masters, h, first, d.grad_scale, d.found_inf, d.lr);
        if (d.grad_scale && d.grad_scale->defined()) write_back(subset, grads);
      }
    }
  }
  return loss;
}

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<FusedSGDParamState, FusedSGDOptions>(archive, *this);
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<FusedSGDParamState, FusedSGDOptions>(archive, *this);
}

}  // namespace fusetrain::optim
