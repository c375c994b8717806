#include "state.h"

#include <fusetrain/amp/float8_linear.h>

#include <sstream>

namespace fusetrain::trainer {

namespace {

CheckpointError misfit(const std::string& path, const std::string& what) {
  return CheckpointError("checkpoint " + path + " does not fit the configured model: " + what +
                         " (was it written with other model.* settings?)");
}

}  // namespace

void put_model(TensorDict& d, const Model& model) {
  for (const auto& p : model->named_parameters()) d.emplace_back("model." + p.key(), p.value());
  for (const auto& b : model->named_buffers()) d.emplace_back("model." + b.key(), b.value());
}

void load_model(const TensorDict& ckpt, const std::string& path, const Model& model) {
  at::NoGradGuard no_grad;
  // A float8 layer's scaling state ("...fp8_scale", "...fp8_amax_history") is
  // optional both ways: a mixed_float8 checkpoint evaluates or resumes under
  // another policy, and a float8 run can start from a bf16 checkpoint (its
  // scaling starts afresh).
  auto is_fp8_state = [](const std::string& name) {
    const size_t dot = name.rfind('.');
    return name.compare(dot == std::string::npos ? 0 : dot + 1, 4, "fp8_") == 0;
  };
  size_t in_file = 0;
  for (const auto& item : ckpt) {
    in_file += item.first.rfind("model.", 0) == 0 && !is_fp8_state(item.first);
  }
  size_t expected = 0;
  auto load = [&](const std::string& name, at::Tensor target) {
    const std::string k = "model." + name;
    if (is_fp8_state(name)) {
      if (!has_entry(ckpt, k)) return;
    } else {
      ++expected;
      if (!has_entry(ckpt, k)) throw misfit(path, "it has no " + name);
    }
    const at::Tensor& t = checkpoint_entry(ckpt, k, path);
    if (t.sizes() != target.sizes()) {
      std::ostringstream msg;
      msg << name << " has shape " << t.sizes() << " there and " << target.sizes() << " here";
      throw misfit(path, msg.str());
    }
    target.copy_(t);
  };
  for (const auto& p : model->named_parameters()) load(p.key(), p.value());
  for (const auto& b : model->named_buffers()) load(b.key(), b.value());
  if (in_file != expected) {
    throw misfit(path, "it holds " + std::to_string(in_file) + " model tensors but the model has " +
                           std::to_string(expected));
  }
  // Float8 layers reread which of their amax histories hold data.
  for (const auto& m : model->modules()) {
    if (auto* f8 = dynamic_cast<amp::Float8LinearImpl*>(m.get())) f8->state_loaded();
  }
}

void put_optimizer(TensorDict& d, const Model& model, optim::FusedOptimizer& optimizer,
                   const std::string& name) {
  d.emplace_back("optim.name", text_tensor(name));
  auto& state = optimizer.state();
  for (const auto& p : model->named_parameters()) {
    const auto it = state.find(p.value().unsafeGetTensorImpl());
    if (it == state.end()) continue;
    const std::string k = "optim." + p.key() + ".";
    auto put = [&](const char* field, const at::Tensor& t) {
      if (t.defined()) d.emplace_back(k + field, t);
    };
    if (name == "adamw") {
      const auto& s = static_cast<const optim::FusedAdamWParamState&>(*it->second);
      put("step", s.step());
      put("exp_avg", s.exp_avg());
      put("exp_avg_sq", s.exp_avg_sq());
      put("max_exp_avg_sq", s.max_exp_avg_sq());
      put("master_param", s.master_param());
    } else {
      const auto& s = static_cast<const optim::FusedSGDParamState&>(*it->second);
      put("momentum_buffer", s.momentum_buffer());
      put("master_param", s.master_param());
    }
  }
}

void load_optimizer(const TensorDict& ckpt, const std::string& path, const Model& model,
                    optim::FusedOptimizer& optimizer, const Config& config,
                    const at::Device& device) {
  const std::string name = tensor_text(checkpoint_entry(ckpt, "optim.name", path));
  if (name != config.get_string("optimizer.name")) {
    throw config.error("optimizer.name", "the checkpoint " + path + " was written with optimizer.name=" +
                                             name + "; its state cannot be resumed by another optimizer");
  }
  // A state tensor on the device in its parameter's layout (the fused
  // kernels walk both in memory order): a checkpoint written in another
  // layout (model.channels_last changed) is copied into this one's.
  auto field = [&](const std::string& k, const at::Tensor& param) {
    if (!has_entry(ckpt, k)) return at::Tensor();
    at::Tensor t = checkpoint_entry(ckpt, k, path).to(device, /*non_blocking=*/false, /*copy=*/true);
    if (t.sizes() == param.sizes() && t.strides() != param.strides()) {
      t = at::empty_like(param, t.options(), at::MemoryFormat::Preserve).copy_(t);
    }
    return t;
  };
  auto& state = optimizer.state();
  for (const auto& p : model->named_parameters()) {
    const std::string k = "optim." + p.key() + ".";
    if (name == "adamw") {
      if (!has_entry(ckpt, k + "exp_avg")) continue;
      auto s = std::make_unique<optim::FusedAdamWParamState>();
      s->step(field(k + "step", p.value()));
      s->exp_avg(field(k + "exp_avg", p.value()));
      s->exp_avg_sq(field(k + "exp_avg_sq", p.value()));
      s->max_exp_avg_sq(field(k + "max_exp_avg_sq", p.value()));
      s->master_param(field(k + "master_param", p.value()));
      state[p.value().unsafeGetTensorImpl()] = std::move(s);
    } else {
      if (!has_entry(ckpt, k + "momentum_buffer") && !has_entry(ckpt, k + "master_param")) continue;
      auto s = std::make_unique<optim::FusedSGDParamState>();
      s->momentum_buffer(field(k + "momentum_buffer", p.value()));
      s->master_param(field(k + "master_param", p.value()));
      state[p.value().unsafeGetTensorImpl()] = std::move(s);
    }
  }
}

void put_scaler(TensorDict& d, amp::GradScaler& scaler) {
  for (const auto& item : scaler.state_dict()) {
    const c10::IValue& v = item.value();
    d.emplace_back("scaler." + item.key().toStringRef(),
                   v.isInt() ? scalar_entry(v.toInt()) : scalar_entry(v.toDouble()));
  }
}

void load_scaler(const TensorDict& ckpt, amp::GradScaler& scaler) {
  if (!scaler.is_enabled() || !has_entry(ckpt, "scaler.scale")) return;
  c10::impl::GenericDict sd(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, t] : ckpt) {
    if (k.rfind("scaler.", 0) != 0) continue;
    const std::string key = k.substr(7);
    if (t.scalar_type() == at::kLong) {
      sd.insert(key, c10::IValue(t.item<int64_t>()));
    } else {
      sd.insert(key, c10::IValue(t.item<double>()));
    }
  }
  scaler.load_state_dict(sd);
}

}  // namespace fusetrain::trainer
