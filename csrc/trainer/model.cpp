// The trainer's model interface: ModelConfig, the model base class and the
// plugin registry (see model.h).
#include <fusetrain/trainer/model.h>

#include <fusetrain/nn/batch_norm.h>
#include <fusetrain/nn/linear_cross_entropy.h>
#include <fusetrain/nn/max_pool.h>

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>

#include <dlfcn.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <set>
#include <sstream>

namespace fusetrain::trainer {

namespace nn = torch::nn;

// ------------------------------------------------------------ ModelConfig

namespace {

const char* type_name(const ModelConfig::Value& v) {
  switch (v.index()) {
    case 0: return "a boolean";
    case 1: return "an integer";
    case 2: return "a number";
    case 3: return "a string";
    default: return "a list of integers";
  }
}

std::string value_text(const ModelConfig::Value& v) {
  std::ostringstream out;
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) {
          out << (x ? "true" : "false");
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          for (size_t i = 0; i < x.size(); ++i) out << (i ? "," : "") << x[i];
        } else {
          out << x;
        }
      },
      v);
  return out.str();
}

}  // namespace

void ModelConfig::set(const std::string& key, Value value, std::string origin) {
  values_[key] = std::move(value);
  origins_[key] = std::move(origin);
}

std::vector<std::string> ModelConfig::keys() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : values_) out.push_back(k);
  return out;
}

const std::string& ModelConfig::origin(const std::string& key) const {
  static const std::string none = "not set";
  const auto it = origins_.find(key);
  return it == origins_.end() ? none : it->second;
}

UsageError ModelConfig::error(const std::string& key, const std::string& message) const {
  const auto it = values_.find(key);
  const std::string shown = it == values_.end() ? "" : "=" + value_text(it->second);
  return UsageError("model." + key + shown + " (" + origin(key) + "): " + message);
}

const ModelConfig::Value& ModelConfig::value(const std::string& key, const char* wanted) const {
  const auto it = values_.find(key);
  if (it == values_.end()) {
    throw UsageError("model." + key + ": the model needs it (" + wanted +
                     "): set it under model: in the config or with --set model." + key + "=...");
  }
  return it->second;
}

int64_t ModelConfig::get_int(const std::string& key) const {
  const Value& v = value(key, "an integer");
  if (const auto* i = std::get_if<int64_t>(&v)) return *i;
  throw error(key, std::string("is ") + type_name(v) + ", and the model reads an integer");
}

int64_t ModelConfig::get_int(const std::string& key, int64_t default_value) const {
  return has(key) ? get_int(key) : default_value;
}

double ModelConfig::get_float(const std::string& key) const {
  const Value& v = value(key, "a number");
  if (const auto* d = std::get_if<double>(&v)) return *d;
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  throw error(key, std::string("is ") + type_name(v) + ", and the model reads a number");
}

double ModelConfig::get_float(const std::string& key, double default_value) const {
  return has(key) ? get_float(key) : default_value;
}

bool ModelConfig::get_bool(const std::string& key) const {
  const Value& v = value(key, "true or false");
  if (const auto* b = std::get_if<bool>(&v)) return *b;
  throw error(key, std::string("is ") + type_name(v) + ", and the model reads true or false");
}

bool ModelConfig::get_bool(const std::string& key, bool default_value) const {
  return has(key) ? get_bool(key) : default_value;
}

const std::string& ModelConfig::get_string(const std::string& key) const {
  const Value& v = value(key, "a string");
  if (const auto* s = std::get_if<std::string>(&v)) return *s;
  throw error(key, std::string("is ") + type_name(v) + ", and the model reads a string");
}

std::string ModelConfig::get_string(const std::string& key, const std::string& default_value) const {
  return has(key) ? get_string(key) : default_value;
}

std::vector<int64_t> ModelConfig::get_int_list(const std::string& key) const {
  const Value& v = value(key, "a list of integers");
  if (const auto* l = std::get_if<std::vector<int64_t>>(&v)) return *l;
  if (const auto* i = std::get_if<int64_t>(&v)) return {*i};
  throw error(key, std::string("is ") + type_name(v) + ", and the model reads a list of integers");
}

std::vector<int64_t> ModelConfig::get_int_list(const std::string& key,
                                               const std::vector<int64_t>& default_value) const {
  return has(key) ? get_int_list(key) : default_value;
}

int64_t DatasetInfo::features() const {
  int64_t n = 1;
  for (int64_t s : input_shape) n *= s;
  return n;
}

// ------------------------------------------------------------ ModelImpl

at::Tensor float32_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                 at::Reduction::Reduction reduction, double label_smoothing) {
  const amp::Float32Guard float32;
  const at::Tensor flat = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
  return at::cross_entropy_loss(flat, targets.reshape({-1}), {}, reduction, -100, label_smoothing);
}

void ModelImpl::make_head(int64_t in, int64_t out, bool float32, const std::string& name, bool bias) {
  nn::Linear linear(nn::LinearOptions(in, out).bias(bias));
  if (float32) {
    head32_ = register_module(name, amp::keep_float32(linear));
  } else {
    head_ = register_module(name, linear);
  }
}

at::Tensor ModelImpl::apply_head(const at::Tensor& x) {
  TORCH_CHECK(head32_ || head_, "apply_head: the model has no head (make_head)");
  return head32_ ? head32_->forward(x) : head_->forward(x);
}

at::Tensor ModelImpl::forward(const at::Tensor& x, const at::Tensor& targets,
                              double label_smoothing) {
  return float32_cross_entropy(forward(x), targets, at::Reduction::Mean, label_smoothing);
}

bool ModelImpl::is_weight_layer(const nn::Module& m) const {
  return dynamic_cast<const nn::Conv2dImpl*>(&m) || dynamic_cast<const nn::LinearImpl*>(&m) ||
         dynamic_cast<const nn::EmbeddingImpl*>(&m);
}

at::Tensor ModelImpl::linear_loss(const at::Tensor& features, const at::Tensor& weight,
                                  const at::Tensor& bias, const at::Tensor& targets,
                                  double label_smoothing, bool float32) {
  // torch's linear_cross_entropy takes rows [N, in]: the positions flattened.
  const at::Tensor rows = features.reshape({-1, features.size(-1)});
  const at::Tensor flat_targets = targets.reshape({-1});
  fusetrain::nn::LinearCrossEntropyFuncOptions options;
  options.label_smoothing = label_smoothing;
  options.linear_bias = bias;
  if (float32) {
    const amp::Float32Guard guard;
    if (options.linear_bias.defined()) options.linear_bias = options.linear_bias.to(at::kFloat);
    return fusetrain::nn::linear_cross_entropy(rows.to(at::kFloat), weight.to(at::kFloat),
                                               flat_targets, options);
  }
  return fusetrain::nn::linear_cross_entropy(rows, weight, flat_targets, options).to(at::kFloat);
}

at::Tensor ModelImpl::head_loss(const at::Tensor& features, const at::Tensor& targets,
                                double label_smoothing) {
  TORCH_CHECK(head32_ || head_, "head_loss: the model has no head (make_head)");
  const nn::Linear& linear = head32_ ? head32_->inner() : head_;
  return linear_loss(features, linear->weight, linear->bias, targets, label_smoothing,
                     head32_ != nullptr);
}

void ModelImpl::use_channels_last() {
  at::NoGradGuard no_grad;
  for (at::Tensor& t : parameters()) {
    if (t.dim() == 4) t.set_data(t.contiguous(at::MemoryFormat::ChannelsLast));
  }
  for (at::Tensor& t : buffers()) {
    if (t.dim() == 4) t.set_data(t.contiguous(at::MemoryFormat::ChannelsLast));
  }
  channels_last_ = true;
}

at::Tensor ModelImpl::as_input(const at::Tensor& x) const {
  if (!channels_last_ || x.dim() != 4) return x;
  if (x.size(1) == 1 && x.is_contiguous()) {
    // One channel (Fashion-MNIST): contiguous(ChannelsLast) keeps the NCHW
    // strides, as valid for one channel, and the first convolution, whose
    // kernel [C, 1, kh, kw] looks NCHW too, then runs and answers in NCHW;
    // every later layer of the block converted it back (copies of each
    // activation of the block, forward and backward). The same memory viewed
    // with channels_last strides keeps the whole network channels_last.
    return x.as_strided(x.sizes(), {x.size(2) * x.size(3), 1, x.size(3), 1});
  }
  return x.contiguous(at::MemoryFormat::ChannelsLast);
}

at::Tensor ModelImpl::batch_norm(nn::BatchNorm2dImpl& bn, const at::Tensor& x, bool relu) const {
  if (fused_batch_norm_) return fusetrain::nn::batch_norm_relu(bn, x, relu);
  at::Tensor y = bn.forward(x);
  return relu ? y.relu_() : y;
}

at::Tensor ModelImpl::max_pool(nn::MaxPool2dImpl& pool, const at::Tensor& x) const {
  return fused_max_pool_ ? fusetrain::nn::max_pool2d(pool, x) : pool.forward(x);
}

// ------------------------------------------------------------ registry

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, ModelFactory> factories;
  std::set<std::string> duplicates;
  // Registrations refused for their ABI: name -> what they were built against.
  std::map<std::string, std::string> foreign;
  std::set<std::string> loaded_paths;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

const char* model_abi() { return FUSETRAIN_MODEL_ABI; }

void register_model(const std::string& name, ModelFactory factory, const char* abi) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  if (std::string(abi) != model_abi()) {
    r.foreign[name] = abi;
    return;
  }
  if (!r.factories.emplace(name, std::move(factory)).second) r.duplicates.insert(name);
}

const ModelFactory* find_registered_model(const std::string& name) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  if (r.duplicates.count(name)) {
    throw UsageError("model.name=" + name + ": registered more than once (two plugins, or one "
                     "library loaded twice under two names, use the same name)");
  }
  const auto it = r.factories.find(name);
  return it == r.factories.end() ? nullptr : &it->second;
}

std::vector<std::string> registered_models() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, f] : r.factories) out.push_back(name);
  return out;
}

void load_model_library(const std::string& path, const std::string& name, const std::string& key) {
  namespace fs = std::filesystem;
  const std::string where = key + "=" + path;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw UsageError(where + ": no such file (a relative path in a config file is relative to "
                     "that file's directory; build the plugin with fusetrain_add_model_plugin)");
  }
  const std::string canonical = fs::canonical(path, ec).string();
  Registry& r = registry();
  bool already = false;
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    already = !r.loaded_paths.insert(canonical).second;
  }
  if (!already) {
    // RTLD_NOW: an unresolved symbol (another torch or fusetrain) fails
    // here, not mid-run. RTLD_LOCAL: the plugin's own symbols stay its own
    // (it resolves torch's and fusetrain's from the process; nothing
    // resolves against it but through the factory it registered).
    if (dlopen(canonical.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
      {
        const std::lock_guard<std::mutex> lock(r.mutex);
        r.loaded_paths.erase(canonical);
      }
      const char* why = dlerror();
      throw UsageError(where + ": cannot be loaded: " + std::string(why ? why : "unknown reason") +
                       " (a plugin must be built against this fusetrain (" + model_abi() +
                       ") with fusetrain_add_model_plugin)");
    }
  }
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    const auto foreign = r.foreign.find(name);
    if (foreign != r.foreign.end() && r.factories.count(name) == 0) {
      throw UsageError(where + ": registers model \"" + name + "\" built against " +
                       foreign->second + ", and this is " + model_abi() +
                       ": rebuild the plugin against this fusetrain (find_package(fusetrain) "
                       "from its install)");
    }
  }
  if (find_registered_model(name) == nullptr) {
    std::string names;
    for (const auto& n : registered_models()) names += (names.empty() ? "" : ", ") + n;
    throw UsageError(where + ": registers no model named \"" + name + "\" (model.name); " +
                     (names.empty() ? std::string("it registers none: is FUSETRAIN_REGISTER_MODEL in "
                                                  "a source file of the library?")
                                    : "registered: " + names));
  }
}

}  // namespace fusetrain::trainer
