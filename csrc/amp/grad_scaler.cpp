// GradScaler: torch.amp.GradScaler's state machine over fusetrain's
// multi-tensor unscale and in-place scale-update ops.
#include <fusetrain/amp/grad_scaler.h>
#include <fusetrain/ops/amp.h>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <algorithm>

namespace fusetrain::amp {

namespace {

std::string device_name(c10::DeviceType t) { return c10::DeviceTypeName(t, /*lower_case=*/true); }

// The gradient list to unscale: sparse gradients contribute their values
// (coalesced first when fp16, as torch does, so duplicates cannot overflow).
at::Tensor unscalable(at::Tensor& grad) {
  if (!grad.defined() || !grad.is_sparse()) return grad;
  if (grad.scalar_type() == at::kHalf) grad = grad.coalesce();
  return grad._values();
}

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.good(), "GradScaler.save: cannot open ", tmp, " for writing");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    TORCH_CHECK(out.good(), "GradScaler.save: writing ", tmp, " failed");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "GradScaler.save: cannot rename ", tmp,
              " to ", path);
}

double number(const c10::IValue& v, const char* key) {
  TORCH_CHECK(v.isDouble() || v.isInt(), "GradScaler.load_state_dict: \"", key,
              "\" must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

int64_t integer(const c10::IValue& v, const char* key) {
  TORCH_CHECK(v.isInt() || (v.isDouble() && v.toDouble() == static_cast<int64_t>(v.toDouble())),
              "GradScaler.load_state_dict: \"", key, "\" must be an integer, got ", v.tagKind());
  return v.isInt() ? v.toInt() : static_cast<int64_t>(v.toDouble());
}

}  // namespace

std::vector<at::Tensor> optimizer_grads(torch::optim::Optimizer& optimizer) {
  if (auto* scaling = dynamic_cast<AmpScalingOptimizer*>(&optimizer)) {
    if (auto grads = scaling->amp_gradients()) return *grads;
  }
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) grads.push_back(p.grad());
  }
  return grads;
}

GradScaler::GradScaler(c10::DeviceType device_type, GradScalerOptions options)
    : device_type_(device_type), options_(options), init_scale_(options.init_scale()) {
  // Any device that holds data, as torch's scaler: CPU and CUDA run our
  // kernels, any other backend (a TPU through torch_tpu) the generic ops.
  TORCH_CHECK_VALUE(device_type != c10::DeviceType::Meta,
                    "GradScaler: device \"meta\" holds no data to scale; construct the scaler "
                    "for the device the model trains on");
  TORCH_CHECK_VALUE(options.init_scale() > 0, "GradScaler: init_scale must be > 0, got ",
                    options.init_scale());
  TORCH_CHECK_VALUE(options.growth_factor() > 1.0,
                    "GradScaler: growth_factor should be > 1, got ", options.growth_factor());
  TORCH_CHECK_VALUE(options.backoff_factor() > 0.0 && options.backoff_factor() < 1.0,
                    "GradScaler: backoff_factor should be in (0, 1), got ",
                    options.backoff_factor());
  TORCH_CHECK_VALUE(options.growth_interval() > 0, "GradScaler: growth_interval should be > 0, got ",
                    options.growth_interval());
  TORCH_CHECK_VALUE(options.max_scale() > 0, "GradScaler: max_scale must be > 0, got ",
                    options.max_scale());
  TORCH_CHECK_VALUE(options.hysteresis() >= 0, "GradScaler: hysteresis must be >= 0, got ",
                    options.hysteresis());
  if (options_.enabled() && device_type == c10::DeviceType::CUDA && !torch::cuda::is_available()) {
    TORCH_WARN("GradScaler is enabled, but CUDA is not available.  Disabling.");
    options_.enabled(false);
  }
}

void GradScaler::check_initialized(const char* fn) const {
  TORCH_CHECK(scale_.defined(), "Attempted ", fn,
              " but the scale is not initialized. This may indicate your script did not use "
              "scaler.scale(loss or outputs) earlier in the iteration.");
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!is_enabled()) return outputs;
  TORCH_CHECK(outputs.device().type() == device_type_, "GradScaler(device=\"",
              device_name(device_type_), "\").scale: outputs are on ", outputs.device(),
              "; scale outputs on ", device_name(device_type_),
              " or construct the scaler for that device");
  if (!scale_.defined()) {
    const auto on = at::TensorOptions().device(outputs.device());
    scale_ = at::full({}, init_scale_, on.dtype(at::kFloat));
    growth_tracker_ = at::full({}, init_growth_tracker_, on.dtype(at::kInt));
    overflow_tracker_ = at::full({}, init_overflow_tracker_, on.dtype(at::kInt));
  }
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const auto& t : outputs) scaled.push_back(scale(t));
  return scaled;
}

void GradScaler::record_inf_checks(PerOptimizer& state, const std::vector<at::Tensor>& grads,
                                   const at::Tensor& inv_scale) {
  // Validate everything before touching anything: a bad gradient leaves the
  // others scaled and the stage unchanged.
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> per_device;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK(at::isFloatingType(g.scalar_type()), "GradScaler: the gradient of parameter ", i,
                " has dtype ", g.scalar_type(),
                "; only float32, float16, bfloat16 and float64 gradients can be unscaled");
    TORCH_CHECK(g.device().type() == device_type_, "GradScaler(device=\"",
                device_name(device_type_), "\"): the gradient of parameter ", i, " is on ",
                g.device(), "; keep the parameters on ", device_name(device_type_),
                " or construct the scaler for ", device_name(g.device().type()));
    auto it = std::find_if(per_device.begin(), per_device.end(),
                           [&](const auto& entry) { return entry.first == g.device(); });
    if (it == per_device.end()) it = per_device.emplace(per_device.end(), g.device(), std::vector<at::Tensor>{});
    it->second.push_back(g);
  }
  for (auto& [device, list] : per_device) {
    at::Tensor found = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    ops::non_finite_check_and_unscale_(list, found, inv_scale.to(device, /*non_blocking=*/true));
    state.found_inf_per_device.emplace_back(device, found);
  }
}

void GradScaler::unscale_grads_(OptimizerKey key, const std::vector<at::Tensor>& grads) {
  if (!is_enabled()) return;
  check_initialized("unscale_");
  PerOptimizer& state = per_optimizer_[key];
  TORCH_CHECK(state.stage != OptState::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != OptState::kStepped, "unscale_() is being called after step().");
  // fp32 reciprocal of a double-precision 1/scale, bit-equal to torch's.
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  record_inf_checks(state, grads, inv_scale);
  state.stage = OptState::kUnscaled;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads = optimizer_grads(optimizer);
  for (auto& g : grads) g = unscalable(g);
  unscale_grads_(reinterpret_cast<OptimizerKey>(&optimizer), grads);
}

at::Tensor GradScaler::combined_found_inf(const PerOptimizer& state) const {
  at::Tensor sum = at::zeros({}, scale_.options());
  for (const auto& entry : state.found_inf_per_device) {
    sum.add_(entry.second.to(scale_.device(), /*non_blocking=*/true));
  }
  return sum;
}

std::pair<std::optional<at::Tensor>, at::Tensor> GradScaler::prepare_step(
    OptimizerKey key, const std::vector<at::Tensor>& grads, bool optimizer_takes_scale) {
  check_initialized("step");
  PerOptimizer& state = per_optimizer_[key];
  TORCH_CHECK(state.stage != OptState::kStepped,
              "step() has already been called since the last update().");
  std::optional<at::Tensor> grad_scale;
  if (optimizer_takes_scale) {
    if (state.stage == OptState::kReady) {
      // Only look for inf/NaN: the optimizer divides by the scale itself.
      record_inf_checks(state, grads, at::ones({}, scale_.options()));
      // A copy, as torch hands `scale * 1`: the optimizer may keep it past
      // update() or write to it without touching the scaler's scale.
      grad_scale = scale_.clone();
    }
    // No check that inf checks were recorded: like torch, an optimizer that
    // takes the scale steps (a no-op) when none of its parameters has a grad.
  } else {
    if (state.stage == OptState::kReady) unscale_grads_(key, grads);
    TORCH_CHECK(!state.found_inf_per_device.empty(),
                "No inf checks were recorded for this optimizer.");
  }
  last_found_inf_ = combined_found_inf(state);
  return {grad_scale, last_found_inf_};
}

void GradScaler::mark_stepped(OptimizerKey key) { per_optimizer_[key].stage = OptState::kStepped; }

OptState GradScaler::stage(OptimizerKey key) const {
  const auto it = per_optimizer_.find(key);
  return it == per_optimizer_.end() ? OptState::kReady : it->second.stage;
}

at::Tensor GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return optimizer.step();
  const auto key = reinterpret_cast<OptimizerKey>(&optimizer);
  std::vector<at::Tensor> grads = optimizer_grads(optimizer);
  for (auto& g : grads) g = unscalable(g);
  auto* fused = dynamic_cast<AmpScalingOptimizer*>(&optimizer);
  auto [grad_scale, found_inf] = prepare_step(key, grads, fused != nullptr);
  at::Tensor result;
  if (fused != nullptr) {
    struct Clear {
      AmpScalingOptimizer* opt;
      ~Clear() { opt->set_amp_scaling(std::nullopt, std::nullopt); }
    } clear{fused};
    fused->set_amp_scaling(grad_scale, found_inf);
    result = optimizer.step();
  } else if (found_inf.item<float>() == 0.f) {  // torch's host sync, for plain optimizers
    result = optimizer.step();
  }
  mark_stepped(key);
  return result;
}

void GradScaler::update() {
  if (!is_enabled()) return;
  check_initialized("update");
  at::Tensor found = at::zeros({}, scale_.options());
  bool any = false;
  for (const auto& entry : per_optimizer_) {
    for (const auto& per_device : entry.second.found_inf_per_device) {
      found.add_(per_device.second.to(scale_.device(), /*non_blocking=*/true));
      any = true;
    }
  }
  TORCH_CHECK(any, "No inf checks were recorded prior to update.");
  ops::ScaleUpdateOptions o;
  o.growth_factor = options_.growth_factor();
  o.backoff_factor = options_.backoff_factor();
  o.growth_interval = options_.growth_interval();
  o.max_scale = options_.max_scale();
  o.hysteresis = options_.hysteresis();
  ops::update_scale_(scale_, growth_tracker_, overflow_tracker_, found, o);
  last_found_inf_ = found;
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!is_enabled()) return;
  check_initialized("update");
  scale_.fill_(new_scale);
  per_optimizer_.clear();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!is_enabled()) return;
  check_initialized("update");
  const char* reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
      "with requires_grad=False.";
  TORCH_CHECK(new_scale.device().type() == device_type_, reason);
  TORCH_CHECK(new_scale.numel() == 1, reason);
  TORCH_CHECK(!new_scale.requires_grad(), reason);
  scale_.copy_(new_scale.reshape({}));
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!is_enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

void GradScaler::set_growth_factor(double v) { options_.growth_factor(v); }
void GradScaler::set_backoff_factor(double v) { options_.backoff_factor(v); }
void GradScaler::set_growth_interval(int64_t v) { options_.growth_interval(v); }

bool GradScaler::step_was_skipped() const {
  return last_found_inf_.defined() && last_found_inf_.item<float>() != 0.f;
}

std::vector<int64_t> GradScaler::non_finite_indices(const std::vector<at::Tensor>& grads) {
  std::vector<int64_t> where;
  std::vector<at::Tensor> flags;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    const at::Tensor values = grads[i].is_sparse() ? grads[i]._values() : grads[i];
    flags.push_back(at::isfinite(values).all().logical_not().to(at::kCPU));
    where.push_back(static_cast<int64_t>(i));
  }
  std::vector<int64_t> bad;
  if (flags.empty()) return bad;
  const at::Tensor all = at::stack(flags);
  const bool* f = all.const_data_ptr<bool>();
  for (size_t k = 0; k < where.size(); ++k) {
    if (f[k]) bad.push_back(where[k]);
  }
  return bad;
}

std::vector<std::string> GradScaler::overflow_report(
    const torch::OrderedDict<std::string, at::Tensor>& named_parameters) {
  std::vector<at::Tensor> grads;
  for (const auto& item : named_parameters) grads.push_back(item.value().grad());
  std::vector<std::string> names;
  for (int64_t i : non_finite_indices(grads)) names.push_back(named_parameters[i].key());
  return names;
}

c10::impl::GenericDict GradScaler::state_dict() const {
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  if (!is_enabled()) return state;
  state.insert("scale", get_scale());
  state.insert("growth_factor", options_.growth_factor());
  state.insert("backoff_factor", options_.backoff_factor());
  state.insert("growth_interval", options_.growth_interval());
  state.insert("_growth_tracker", growth_tracker_.defined()
                                      ? static_cast<int64_t>(growth_tracker_.item<int32_t>())
                                      : init_growth_tracker_);
  if (options_.max_scale() != std::numeric_limits<double>::infinity()) {
    state.insert("max_scale", options_.max_scale());
  }
  if (options_.hysteresis() > 0) {
    state.insert("hysteresis", options_.hysteresis());
    state.insert("_overflow_tracker",
                 overflow_tracker_.defined()
                     ? static_cast<int64_t>(overflow_tracker_.item<int32_t>())
                     : init_overflow_tracker_);
  }
  return state;
}

void GradScaler::load_state_dict(const c10::impl::GenericDict& state) {
  if (!is_enabled()) return;
  TORCH_CHECK(state.size() != 0,
              "The source state dict is empty, possibly because it was saved from a disabled "
              "instance of GradScaler.");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval",
                          "_growth_tracker"}) {
    TORCH_CHECK(state.contains(std::string(key)), "GradScaler.load_state_dict: missing key \"", key, "\"");
  }
  init_scale_ = number(state.at("scale"), "scale");
  options_.growth_factor(number(state.at("growth_factor"), "growth_factor"));
  options_.backoff_factor(number(state.at("backoff_factor"), "backoff_factor"));
  options_.growth_interval(integer(state.at("growth_interval"), "growth_interval"));
  init_growth_tracker_ = integer(state.at("_growth_tracker"), "_growth_tracker");
  if (state.contains("max_scale")) options_.max_scale(number(state.at("max_scale"), "max_scale"));
  if (state.contains("hysteresis")) {
    options_.hysteresis(integer(state.at("hysteresis"), "hysteresis"));
  }
  init_overflow_tracker_ =
      state.contains("_overflow_tracker")
          ? integer(state.at("_overflow_tracker"), "_overflow_tracker")
          : 0;
  if (scale_.defined()) {
    scale_.fill_(init_scale_);
    growth_tracker_.fill_(init_growth_tracker_);
    overflow_tracker_.fill_(init_overflow_tracker_);
  }
}

void GradScaler::save(const std::string& path) const {
  // torch::pickle_save's format, but with aggregates untagged: its type tags
  // (torch.jit._pickle.restore_type_tag) make torch.load's default
  // weights_only=True unpickler refuse the file.
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* buf, size_t n) { pickled.insert(pickled.end(), buf, buf + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(state_dict()));
  pickler.stop();
  std::vector<char> bytes;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* buf, size_t n) {
      const char* b = static_cast<const char*>(buf);
      bytes.insert(bytes.end(), b, b + n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(),
                                       pickler.tensorData(), writer);
    writer.writeEndOfFile();
  }
  write_file_atomically(path, bytes);
}

void GradScaler::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "GradScaler.load: cannot open ", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  const c10::IValue value = torch::pickle_load(bytes);
  TORCH_CHECK(value.isGenericDict(), "GradScaler.load: ", path,
              " does not hold a dict (a scaler state_dict)");
  load_state_dict(value.toGenericDict());
}

}  // namespace fusetrain::amp
