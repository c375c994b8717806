// The model interface of `fusetrain train`, public so that a user's own
// model can be a C++ plugin (a shared library the CLI loads):
//
//   #include <fusetrain/trainer/model.h>
//
//   class TwoLayerImpl : public fusetrain::trainer::ModelImpl {
//    public:
//     TwoLayerImpl(const fusetrain::trainer::ModelConfig& c, const fusetrain::trainer::DatasetInfo& d) {
//       hidden_ = register_module("hidden", torch::nn::Linear(d.features(), c.get_int("hidden_width", 256)));
//       make_head(c.get_int("hidden_width", 256), d.num_classes, c.float32_head());
//     }
//     at::Tensor forward(const at::Tensor& x) override {
//       return apply_head(hidden_(x.flatten(1)).relu());
//     }
//    private:
//     torch::nn::Linear hidden_{nullptr};
//   };
//   FUSETRAIN_REGISTER_MODEL("two_layer", [](const auto& c, const auto& d) {
//     return std::make_shared<TwoLayerImpl>(c, d);
//   });
//
// built with fusetrain_add_model_plugin() (find_package(fusetrain)) and run
// with `model.name: two_layer` and `model.library: libtwo_layer.so`.
// Everything the trainer does to its built-in models (checkpoints, resume,
// eval, export --state-dict, DDP and ZeRO, precision policies, float32
// islands, step fusion) it does to a plugin's: they all act on the module's
// registered parameters and buffers, whose names are the checkpoint's.
#pragma once

#include <fusetrain/amp/float32_module.h>
#include <fusetrain/trainer/usage_error.h>
#include <fusetrain_version.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/version.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace fusetrain::trainer {

/// The `model.*` section of a run's configuration, as a plugin's factory
/// receives it: every key of the trainer's schema (`model.dropout`,
/// `model.seq_len`, ...: typed by the schema, at its default unless set),
/// and every other key the config sets under `model:`, typed as YAML reads
/// it. A plugin's own keys must not reuse a schema name (`fusetrain train
/// --list-keys`), whose default would shadow the plugin's. Keys are named
/// without the section: get_int("block_width") reads `model.block_width`.
/// A missing key without a default, or one of another type, is a
/// UsageError naming the key and where it was set.
class ModelConfig {
 public:
  using Value = std::variant<bool, int64_t, double, std::string, std::vector<int64_t>>;

  /// Sets `key` ("width", without "model.") to `value`; `origin` says where
  /// it came from (a file:line, --set, "default") for error messages.
  void set(const std::string& key, Value value, std::string origin);

  bool has(const std::string& key) const { return values_.count(key) != 0; }
  /// The keys, sorted.
  std::vector<std::string> keys() const;
  const std::string& origin(const std::string& key) const;

  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t default_value) const;
  /// A float; an integer value reads as one too.
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double default_value) const;
  bool get_bool(const std::string& key) const;
  bool get_bool(const std::string& key, bool default_value) const;
  const std::string& get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& default_value) const;
  /// A list of integers; a single integer reads as a list of one.
  std::vector<int64_t> get_int_list(const std::string& key) const;
  std::vector<int64_t> get_int_list(const std::string& key,
                                    const std::vector<int64_t>& default_value) const;

  /// precision.float32_head: whether make_head() should keep the head in
  /// float32 under a mixed policy (a float32 island).
  bool float32_head() const { return float32_head_; }
  void set_float32_head(bool v) { float32_head_ = v; }
  /// precision.policy, resolved ("float32", "mixed_bfloat16", ...).
  const std::string& precision_policy() const { return precision_policy_; }
  void set_precision_policy(std::string p) { precision_policy_ = std::move(p); }

  /// A UsageError "model.KEY=VALUE (ORIGIN): message" for a value the model
  /// cannot use.
  [[nodiscard]] UsageError error(const std::string& key, const std::string& message) const;

 private:
  const Value& value(const std::string& key, const char* wanted) const;

  std::map<std::string, Value> values_;
  std::map<std::string, std::string> origins_;
  bool float32_head_ = true;
  std::string precision_policy_ = "float32";
};

/// What the model is trained on, from the dataset the config names.
struct DatasetInfo {
  /// Classes (images, feature vectors) or the vocabulary (tokens).
  int64_t num_classes = 0;
  /// One sample's shape: [C, H, W] images, [F] feature vectors, [T] token
  /// windows (int64 ids; the targets are the windows shifted by one).
  std::vector<int64_t> input_shape;
  bool is_tokens = false;
  /// E.g. "fashion_mnist (60000 train / 10000 test)".
  std::string description;

  /// The product of input_shape: what a flattened sample holds.
  int64_t features() const;
};

/// Cross-entropy in float32 (a float32 island) of logits [N, C] or
/// [N, T, V] against targets [N] or [N, T], with torch's label smoothing.
at::Tensor float32_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                 at::Reduction::Reduction reduction = at::Reduction::Mean,
                                 double label_smoothing = 0.0);

/// A classifier or language model: forward() returns logits, [N, classes]
/// or [N, T, vocabulary]. Built-in models and plugins derive from it.
class ModelImpl : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  /// The same function written without sizes taken from `x` (which a trace
  /// would freeze): what `fusetrain export --torchscript` traces. Models
  /// whose forward already takes none keep forward().
  virtual at::Tensor forward_for_trace(const at::Tensor& x) { return forward(x); }
  /// The training loss of `x` against `targets`: the mean cross-entropy in
  /// float32 with torch's label smoothing. By default forward(x), then
  /// float32_cross_entropy of the logits; a model whose head is a linear
  /// layer overrides it with head_loss(), which never holds the logits.
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& targets,
                             double label_smoothing);
  /// Whether precision.master_weights keeps `module` (one of this model's
  /// submodules) in 16 bits: by default convolutions, linear layers and
  /// embeddings; normalisation layers and the head stay float32.
  virtual bool is_weight_layer(const torch::nn::Module& module) const;

  /// model.channels_last: the 4-D parameters and buffers (convolution
  /// kernels) in channels_last layout, and forward() takes its images in it
  /// (a copy of an NCHW batch; a view of a one-channel one, whose memory is
  /// the same in both layouts). oneDNN's convolutions, batch norm and
  /// pooling run faster on it (bench/bench_trainer.py); the values, names
  /// and shapes are unchanged, so checkpoints are the same.
  void use_channels_last();
  bool channels_last() const { return channels_last_; }

  /// model.fused_batch_norm: each batch norm + ReLU pair (and a batch norm
  /// alone) runs as fusetrain::nn::batch_norm_relu, one fused op each way on
  /// the CPU; torch's ops where off. Same parameters, buffers and names.
  /// `fusetrain export` turns it off: the traced module is plain torch.
  void set_fused_batch_norm(bool fused) { fused_batch_norm_ = fused; }
  /// model.fused_max_pool: each max pooling over non-overlapping windows runs
  /// as fusetrain::nn::max_pool2d (Note [Window max pool]): the same values
  /// and gradients bit for bit, with fewer passes on the CPU. Off for export.
  void set_fused_max_pool(bool fused) { fused_max_pool_ = fused; }

 protected:
  /// x as the first layer takes it: channels_last under use_channels_last().
  at::Tensor as_input(const at::Tensor& x) const;
  /// Registers the final layer as `name` (a linear layer with a bias), in
  /// float32 when `float32` (ModelConfig::float32_head()).
  void make_head(int64_t in, int64_t out, bool float32, const std::string& name = "head",
                 bool bias = true);
  at::Tensor apply_head(const at::Tensor& x);
  /// The mean cross-entropy of the head applied to `features` [..., in]
  /// against `targets` [...] by fusetrain::nn::linear_cross_entropy, over
  /// chunks of rows without the [rows, classes] logits (Note [Chunked linear
  /// cross-entropy]); in float32 when the head is a float32 island, else in
  /// the autocast dtype. float32, like float32_cross_entropy.
  at::Tensor head_loss(const at::Tensor& features, const at::Tensor& targets,
                       double label_smoothing);
  /// The same for a head whose weight [classes, in] (and bias, if defined)
  /// the model holds elsewhere, e.g. tied to its token embedding.
  static at::Tensor linear_loss(const at::Tensor& features, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& targets,
                                double label_smoothing, bool float32);
  /// bn(x), then a ReLU when `relu`: fused or torch's (set_fused_batch_norm).
  at::Tensor batch_norm(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x, bool relu) const;
  bool fused_batch_norm() const { return fused_batch_norm_; }
  /// pool(x): fusetrain's window max pool or the module (set_fused_max_pool).
  at::Tensor max_pool(torch::nn::MaxPool2dImpl& pool, const at::Tensor& x) const;

 private:
  bool channels_last_ = false;
  bool fused_batch_norm_ = false;
  bool fused_max_pool_ = false;
  torch::nn::Linear head_{nullptr};
  std::shared_ptr<amp::Float32Impl<torch::nn::Linear>> head32_;
};

using Model = std::shared_ptr<ModelImpl>;

/// Builds a model from the config's `model.*` section for the dataset.
using ModelFactory = std::function<Model(const ModelConfig&, const DatasetInfo&)>;

/// What a plugin must have been compiled against to load into this
/// libfusetrain: fusetrain's version, torch's major.minor and the model
/// interface's revision. A plugin records its own when it registers.
#define FUSETRAIN_MODEL_INTERFACE 1
#define FUSETRAIN_DETAIL_STR2(x) #x
#define FUSETRAIN_DETAIL_STR(x) FUSETRAIN_DETAIL_STR2(x)
#define FUSETRAIN_MODEL_ABI                                                          \
  "fusetrain " FUSETRAIN_VERSION_STRING ", torch " FUSETRAIN_DETAIL_STR(             \
      TORCH_VERSION_MAJOR) "." FUSETRAIN_DETAIL_STR(TORCH_VERSION_MINOR) ", model interface " \
      FUSETRAIN_DETAIL_STR(FUSETRAIN_MODEL_INTERFACE)

/// Registers `factory` as `model.name: name`. `abi` is what the caller was
/// compiled against (FUSETRAIN_MODEL_ABI); one that differs from this
/// library's is recorded, not registered, and load_model_library reports it.
/// Registering a name twice is an error when the model is looked up.
void register_model(const std::string& name, ModelFactory factory,
                    const char* abi = FUSETRAIN_MODEL_ABI);

/// This libfusetrain's FUSETRAIN_MODEL_ABI.
const char* model_abi();

/// The factory registered as `name`, or nullptr.
const ModelFactory* find_registered_model(const std::string& name);
/// The registered names, sorted.
std::vector<std::string> registered_models();

/// Loads the plugin library at `path` (dlopen; its FUSETRAIN_REGISTER_MODEL
/// lines run as it loads) and checks that it registered `name`; a UsageError
/// naming `key` (the config key that gave the path) and the library when it
/// does not exist, cannot be loaded (with the loader's reason), was built
/// against another fusetrain or torch, or does not register `name` (with
/// the names it does register). Loading the same path again is a no-op.
void load_model_library(const std::string& path, const std::string& name,
                        const std::string& key = "model.library");

namespace detail {
struct ModelRegistrar {
  ModelRegistrar(const char* name, ModelFactory factory, const char* abi) {
    register_model(name, std::move(factory), abi);
  }
};
}  // namespace detail

}  // namespace fusetrain::trainer

#define FUSETRAIN_DETAIL_CAT2(a, b) a##b
#define FUSETRAIN_DETAIL_CAT(a, b) FUSETRAIN_DETAIL_CAT2(a, b)

/// Registers a model factory under `name` when the library loads:
///   FUSETRAIN_REGISTER_MODEL("my_model", [](const fusetrain::trainer::ModelConfig& c,
///                                           const fusetrain::trainer::DatasetInfo& d) {
///     return std::make_shared<MyModelImpl>(c, d);
///   });
#define FUSETRAIN_REGISTER_MODEL(name, ...)                                                       \
  static const ::fusetrain::trainer::detail::ModelRegistrar FUSETRAIN_DETAIL_CAT(                 \
      fusetrain_model_registrar_, __LINE__)((name), ::fusetrain::trainer::ModelFactory(__VA_ARGS__), \
                                            FUSETRAIN_MODEL_ABI)
