// TorchScript models: a mirror of the module's tree holding its tensors.
#include "torchscript_model.h"

#include "checkpoint.h"

#include <torch/script.h>

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

namespace fusetrain::trainer {

namespace {

/// One submodule of the TorchScript module: its direct parameters and
/// buffers (the same tensors), and a mirror of each child.
class ScriptPartImpl : public torch::nn::Module {
 public:
  explicit ScriptPartImpl(const torch::jit::Module& part) : type_(type_name(part)) {
    mirror(*this, part);
  }
  const std::string& type() const { return type_; }

  static std::string type_name(const torch::jit::Module& m) {
    return m.type()->name() ? m.type()->name()->qualifiedName() : "";
  }

  static void mirror(torch::nn::Module& self, const torch::jit::Module& part) {
    for (const auto& p : part.named_parameters(/*recurse=*/false)) {
      self.register_parameter(p.name, p.value, p.value.requires_grad());
    }
    for (const auto& b : part.named_buffers(/*recurse=*/false)) self.register_buffer(b.name, b.value);
    for (const auto& child : part.named_children()) {
      self.register_module(child.name, std::make_shared<ScriptPartImpl>(child.value));
    }
  }

 private:
  std::string type_;
};

class TorchScriptImpl : public ModelImpl {
 public:
  TorchScriptImpl(torch::jit::Module module, std::string path)
      : module_(std::move(module)), path_(std::move(path)) {
    ScriptPartImpl::mirror(*this, module_);
  }

  at::Tensor forward(const at::Tensor& x) override {
    const c10::IValue out = module_.forward({x});
    if (!out.isTensor()) {
      throw UsageError("model.path: " + path_ + ": forward(x) returned a " + out.tagKind() +
                       ", where the trainer needs a tensor of logits");
    }
    return out.toTensor();
  }

  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_.train(on);
  }

 private:
  torch::jit::Module module_;
  std::string path_;
};

torch::jit::Module load_module(const std::string& path) {
  try {
    return torch::jit::load(path);
  } catch (const c10::Error& e) {
    throw UsageError("model.path: " + path + " is not a TorchScript module that torch.jit.load "
                     "reads (save one with torch.jit.save(torch.jit.script(model), path)): " +
                     e.what_without_backtrace());
  }
}

}  // namespace

Model load_torchscript_model(const Config& config, const Dataset& data) {
  const std::string& path = config.get_string("model.path");
  if (path.empty()) throw config.error("model.path", "model.name=torchscript needs the module's file");
  auto model = std::make_shared<TorchScriptImpl>(load_module(path), path);
  // One forward on two samples, in eval mode (no dropout draw, no batch-norm
  // update), to fail now with a clear message rather than at step 1.
  const at::Tensor x = data.train.inputs.narrow(0, 0, std::min<int64_t>(2, data.train.size())).cpu();
  const std::string input = c10::str(x.sizes()) + " " + c10::toString(x.scalar_type());
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    model->eval();
    try {
      y = model->forward(x);
    } catch (const UsageError&) {
      throw;
    } catch (const std::exception& e) {
      throw UsageError("model.path: " + path + ": forward(x) with a batch x of " + input +
                       " (as data.name=" + config.get_string("data.name") +
                       " gives) raised: " + e.what());
    }
    model->train();
  }
  std::vector<int64_t> expected = {x.size(0)};
  if (data.is_tokens) expected.push_back(x.size(1));
  expected.push_back(data.num_classes);
  if (!at::isFloatingType(y.scalar_type()) || y.sizes() != c10::IntArrayRef(expected)) {
    throw UsageError("model.path: " + path + ": forward(x) with x of " + input + " returned " +
                     c10::str(y.sizes()) + " " + c10::toString(y.scalar_type()) +
                     "; the trainer needs floating-point logits of shape " +
                     c10::str(c10::IntArrayRef(expected)) +
                     (data.is_tokens ? " (batch, tokens, vocabulary)" : " (batch, classes)"));
  }
  return model;
}

bool is_torchscript_weight_layer(const torch::nn::Module& module) {
  const auto* part = dynamic_cast<const ScriptPartImpl*>(&module);
  if (part == nullptr) return false;
  for (const char* kind : {"torch.nn.modules.conv.Conv", "torch.nn.modules.linear.Linear",
                           "torch.nn.modules.sparse.Embedding"}) {
    if (part->type().find(kind) != std::string::npos) return true;
  }
  return false;
}

void export_torchscript(const std::string& checkpoint, const std::string& module_path,
                        const std::string& out) {
  const TensorDict ckpt = read_checkpoint(checkpoint);
  torch::jit::Module module = load_module(module_path);
  at::NoGradGuard no_grad;
  for (const auto& p : module.named_parameters()) {
    const at::Tensor& t = checkpoint_entry(ckpt, "model." + p.name, checkpoint);
    p.value.copy_(t);
  }
  for (const auto& b : module.named_buffers()) {
    b.value.copy_(checkpoint_entry(ckpt, "model." + b.name, checkpoint));
  }
  // Atomically, as checkpoints: a crash leaves the old file or the new one.
  const std::string tmp = out + ".tmp" + std::to_string(::getpid());
  module.save(tmp);
  if (std::rename(tmp.c_str(), out.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write " + out + ": " + std::strerror(errno));
  }
}

}  // namespace fusetrain::trainer
