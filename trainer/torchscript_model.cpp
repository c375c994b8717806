// TorchScript models: a mirror of the module's tree holding its tensors.
#include "torchscript_model.h"

#include "checkpoint.h"
#include "run_dir.h"
#include "state.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/autocast.h>
#include <torch/csrc/jit/python/update_graph_executor_opt.h>
#include <torch/library.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <utility>

namespace fusetrain::trainer {

namespace {

// ------------------------------------------------------- float32 islands
//
// Note [TorchScript float32 islands]
// A named submodule runs in float32 when every call of its forward is
// wrapped, in its caller's graph, by three ops of the trainer's own:
//   %state = float32_island_enter()          autocast off on every device
//   %x32   = float32_island_input(%x)        each tensor argument to float32
//   %y     = prim::CallMethod[forward](%sub, %x32, ...)
//   float32_island_exit(%state)              autocast as it was
// (what fusetrain.amp.keep_float32's hooks do in Python). The calls are
// rewritten in the caller rather than in the submodule's own graph because
// TorchScript shares one graph among the instances of a module type (every
// Linear of a model, say): the caller's graph names the instance by its
// attribute path. A caller's graph is shared by its type's instances too, so
// a call is wrapped only when it is selected for all of them, and a
// selection that holds for some instances only is an error. The JIT's own
// autocast pass, which would bake its casts into the graph without seeing
// the islands, is turned off with the graph optimisations (for every
// TorchScript model, see load_torchscript_model): eager autocast (the
// dispatcher's) applies to every op the interpreter runs, and the
// enter/exit ops switch it.

constexpr c10::DeviceType kAutocastDevices[] = {c10::DeviceType::CPU, c10::DeviceType::CUDA};

int64_t island_enter() {
  int64_t state = 0;
  for (size_t i = 0; i < std::size(kAutocastDevices); ++i) {
    if (at::autocast::is_autocast_enabled(kAutocastDevices[i])) state |= int64_t{1} << i;
    at::autocast::set_autocast_enabled(kAutocastDevices[i], false);
  }
  return state;
}

void island_exit(int64_t state) {
  for (size_t i = 0; i < std::size(kAutocastDevices); ++i) {
    at::autocast::set_autocast_enabled(kAutocastDevices[i], ((state >> i) & 1) != 0);
  }
}

at::Tensor island_input(const at::Tensor& x) {
  return x.is_floating_point() && x.scalar_type() != at::kFloat ? x.to(at::kFloat) : x;
}

TORCH_LIBRARY_FRAGMENT(fusetrain_trainer, m) {
  // CONSERVATIVE: side effects, so the graph passes neither drop nor move them.
  m.def(torch::schema("float32_island_enter() -> int", c10::AliasAnalysisKind::CONSERVATIVE),
        &island_enter);
  m.def(torch::schema("float32_island_exit(int state) -> ()", c10::AliasAnalysisKind::CONSERVATIVE),
        &island_exit);
  m.def("float32_island_input(Tensor(a) x) -> Tensor(a)", &island_input);  // as aten::to
}

/// The attribute path from the graph's `self` (input 0) to `v`: "head",
/// "blocks.0"; empty when `v` is not a chain of prim::GetAttr from self.
std::string attribute_path(torch::jit::Value* v, torch::jit::Value* self) {
  std::vector<std::string> parts;
  while (v != self) {
    torch::jit::Node* n = v->node();
    if (n->kind() != c10::prim::GetAttr) return "";
    parts.push_back(n->s(c10::attr::name));
    v = n->input(0);
  }
  std::string path;
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) path += (path.empty() ? "" : ".") + *it;
  return path;
}

void forward_calls(torch::jit::Block* block, torch::jit::Value* self,
                   std::vector<std::pair<torch::jit::Node*, std::string>>& out) {
  for (torch::jit::Node* n : block->nodes()) {
    for (torch::jit::Block* sub : n->blocks()) forward_calls(sub, self, out);
    if (n->kind() == c10::prim::CallMethod && n->s(c10::attr::name) == "forward") {
      const std::string path = attribute_path(n->input(0), self);
      if (!path.empty()) out.emplace_back(n, path);
    }
  }
}

void wrap_in_float32(torch::jit::Graph& graph, torch::jit::Node* call) {
  using torch::jit::Symbol;
  torch::jit::Node* enter =
      graph.create(Symbol::fromQualString("fusetrain_trainer::float32_island_enter"), 1);
  enter->output()->setType(c10::IntType::get());
  enter->insertBefore(call);
  for (size_t i = 1; i < call->inputs().size(); ++i) {
    torch::jit::Value* in = call->input(i);
    if (!in->type()->isSubtypeOf(*c10::TensorType::get())) continue;
    torch::jit::Node* cast =
        graph.create(Symbol::fromQualString("fusetrain_trainer::float32_island_input"), {in}, 1);
    cast->output()->setType(c10::TensorType::get());
    cast->insertBefore(call);
    call->replaceInput(i, cast->output());
  }
  torch::jit::Node* exit =
      graph.create(Symbol::fromQualString("fusetrain_trainer::float32_island_exit"), {enter->output()}, 0);
  exit->insertAfter(call);
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "(none)" : s;
}

/// Makes the submodules named in precision.float32_modules (comma-separated,
/// as in the Python module's named_modules()) float32 islands; see Note
/// [TorchScript float32 islands]. Before the module's first run.
void make_float32_islands(torch::jit::Module& module, const Config& config, const std::string& path) {
  std::set<std::string> selected;
  std::stringstream list(config.get_string("precision.float32_modules"));
  for (std::string name; std::getline(list, name, ',');) {
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) selected.insert(name);
  }
  if (selected.empty()) return;
  // Every instance by path, grouped by the graph of its forward.
  std::vector<std::string> names;
  std::map<std::shared_ptr<torch::jit::Graph>, std::vector<std::string>> instances;
  for (const auto& m : module.named_modules()) {
    if (!m.name.empty()) names.push_back(m.name);
    const auto forward = m.value.find_method("forward");
    if (!forward) continue;
    instances[torch::jit::toGraphFunction(forward->function()).graph()].push_back(m.name);
  }
  for (const auto& name : selected) {
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      throw config.error("precision.float32_modules",
                         "the module in " + path + " has no submodule named \"" + name +
                             "\"; it has " + joined(names));
    }
  }
  std::set<std::string> wrapped;
  for (const auto& [graph, callers] : instances) {
    torch::jit::Graph& g = *graph;
    std::vector<std::pair<torch::jit::Node*, std::string>> calls;
    forward_calls(g.block(), g.inputs()[0], calls);
    for (const auto& [node, rel] : calls) {
      std::vector<std::string> in, out;
      for (const auto& caller : callers) {
        const std::string callee = caller.empty() ? rel : caller + "." + rel;
        (selected.count(callee) ? in : out).push_back(callee);
      }
      if (in.empty()) continue;
      if (!out.empty()) {
        throw config.error("precision.float32_modules",
                           "TorchScript runs " + joined(in) + " and " + joined(out) +
                               " through one graph (their parents share a module type): name all "
                               "of them or none");
      }
      wrap_in_float32(g, node);
      wrapped.insert(in.begin(), in.end());
    }
  }
  for (const auto& name : selected) {
    if (!wrapped.count(name)) {
      throw config.error("precision.float32_modules",
                         name + " in " + path + " is never called through its forward() by its "
                                "parent (an island wraps those calls)");
    }
  }
}

/// One submodule of the TorchScript module: its direct parameters and
/// buffers (the same tensors), and a mirror of each child.
class ScriptPartImpl : public torch::nn::Module {
 public:
  explicit ScriptPartImpl(const torch::jit::Module& part) : type_(type_name(part)) {
    mirror(*this, part);
  }
  const std::string& type() const { return type_; }

  /// The module's class, as written in Python. TorchScript mangles the name
  /// of a class it compiles again in one process with other attributes
  /// ("torch.nn.modules.linear.___torch_mangle_0.Linear": any user who
  /// scripted two models before saving this one); the mangling is left out.
  static std::string type_name(const torch::jit::Module& m) {
    if (!m.type()->name()) return "";
    static const std::regex mangled(R"(___torch_mangle_\d+\.)");
    return std::regex_replace(m.type()->name()->qualifiedName(), mangled, "");
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

// What a file torch.jit.load refused is, when it is a torch.save archive
// (a zip holding data.pkl and no TorchScript code): a state dict, a
// fusetrain checkpoint, or another pickled object. "" for anything else.
std::string torch_save_kind(const std::string& path) {
  std::string pickle;  // data.pkl, whose class names say what was saved
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    if (!reader.hasRecord("data.pkl") || reader.hasRecord("constants.pkl")) return "";
    const auto [data, size] = reader.getRecord("data.pkl");
    pickle.assign(static_cast<const char*>(data.get()), size);
  } catch (const std::exception&) {
    return "";  // not a zip archive
  }
  const std::string saved = "a file written by torch.save";
  const std::string state_dict =
      "a state dict (torch.save(model.state_dict())): the weights without the code that uses them";
  torch::IValue value;
  try {
    std::ifstream in(path, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    value = torch::pickle_load(bytes);
  } catch (const std::exception&) {
    // torch's C++ unpickler reads no OrderedDict (what state_dict() returns)
    // and no Python class: tell them apart by the classes the pickle names.
    if (pickle.find("torch.nn.modules") != std::string::npos) {
      return saved + " (a pickled module, torch.save(model): its Python classes are not in the file)";
    }
    if (pickle.find("OrderedDict") != std::string::npos &&
        pickle.find("_rebuild_tensor") != std::string::npos) {
      return state_dict;
    }
    return saved + " (a pickled Python object)";
  }
  if (!value.isGenericDict()) return saved;
  bool all_tensors = true;
  for (const auto& item : value.toGenericDict()) {
    if (item.key().isString() && item.key().toStringRef() == "meta.format") {
      return "a fusetrain checkpoint (fusetrain export --checkpoint " + path +
             " --torchscript OUT.pt writes its model as a module; --resume continues it)";
    }
    all_tensors = all_tensors && item.value().isTensor();
  }
  return all_tensors ? state_dict : saved + " (a dict)";
}

torch::jit::Module load_module(const std::string& path) {
  try {
    return torch::jit::load(path);
  } catch (const c10::Error& e) {
    const std::string kind = torch_save_kind(path);
    if (!kind.empty()) {
      throw UsageError("model.path: " + path + " is not a TorchScript module but " + kind +
                       "; save the module itself with torch.jit.save(torch.jit.script(model), path)");
    }
    throw UsageError("model.path: " + path + " is not a TorchScript module that torch.jit.load "
                     "reads (save one with torch.jit.save(torch.jit.script(model), path)): " +
                     e.what_without_backtrace());
  }
}

// The line that says what failed in an error from a TorchScript forward
// (whose message is the interpreter's traceback, then the error): the last
// "...Error: " line, else the first line.
std::string error_line(const std::string& what) {
  std::istringstream lines(what);
  std::string line, first, last;
  while (std::getline(lines, line)) {
    if (first.empty() && !line.empty()) first = line;
    const auto at = line.find("Error: ");
    if (at != std::string::npos) last = line.substr(at + 7);
  }
  return last.empty() ? first : last;
}

}  // namespace

Model load_torchscript_model(const Config& config, const Dataset& data) {
  const std::string& path = config.get_string("model.path");
  if (path.empty()) throw config.error("model.path", "model.name=torchscript needs the module's file");
  torch::jit::Module module = load_module(path);
  // The module runs op by op as eager PyTorch runs it: the same kernels, the
  // dispatcher's autocast and autograd. The JIT's autocast pass would bake
  // the autocast state of its first optimisation into the graph (islands
  // or not), and without that pass its symbolic autodiff would differentiate
  // through autocast's casts as if they were not there (a bfloat16 gradient
  // against a float32 weight); so both are off. (The optimisation switch is
  // per thread: this one, the training thread.)
  torch::jit::setAutocastMode(false);
  torch::jit::setGraphExecutorOptimize(false);
  make_float32_islands(module, config, path);
  auto model = std::make_shared<TorchScriptImpl>(std::move(module), path);
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
      // A c10::Error, or on some torch versions the interpreter's own
      // exception type: the message either way.
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      const std::string cause = error_line(c10_error ? c10_error->what_without_backtrace() : e.what());
      // A first Linear layer of another width: "mat1 and mat2 shapes cannot
      // be multiplied (2x20 and 784x128)" says both widths.
      long rows = 0, data_width = 0, layer_width = 0, out = 0;
      const auto shapes = cause.find("cannot be multiplied (");
      if (shapes != std::string::npos &&
          std::sscanf(cause.c_str() + shapes, "cannot be multiplied (%ldx%ld and %ldx%ld)", &rows,
                      &data_width, &layer_width, &out) == 4) {
        throw UsageError("model.path: " + path + ": forward(x) with a batch x of " + input +
                         " (as data.name=" + config.get_string("data.name") + " gives) raised: a "
                         "layer takes inputs of width " + std::to_string(layer_width) +
                         " and was given width " + std::to_string(data_width) + " (" + cause + ")");
      }
      throw UsageError("model.path: " + path + ": forward(x) with a batch x of " + input +
                       " (as data.name=" + config.get_string("data.name") + " gives) raised: " + cause);
    }
    model->train();
  }
  std::vector<int64_t> expected = {x.size(0)};
  if (data.is_tokens) expected.push_back(x.size(1));
  expected.push_back(data.num_classes);
  if (!at::isFloatingType(y.scalar_type()) || y.sizes() != c10::IntArrayRef(expected)) {
    // When the class counts disagree, either side may be wrong: say where the
    // trainer's count came from.
    const bool classes_differ = y.dim() == 0 || y.sizes().back() != data.num_classes;
    throw UsageError("model.path: " + path + ": forward(x) with x of " + input + " returned " +
                     c10::str(y.sizes()) + " " + c10::toString(y.scalar_type()) +
                     "; the trainer needs floating-point logits of shape " +
                     c10::str(c10::IntArrayRef(expected)) +
                     (data.is_tokens ? " (batch, tokens, vocabulary)" : " (batch, classes)") +
                     (classes_differ && !data.num_classes_origin.empty()
                          ? ". Its " + std::to_string(data.num_classes) + " " +
                                (data.is_tokens ? "vocabulary entries" : "classes") +
                                ": " + data.num_classes_origin
                          : std::string()));
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

namespace {

/// Atomically, as checkpoints: a crash leaves the old file or the new one.
void save_atomically(const torch::jit::Module& module, const std::string& out) {
  const std::string tmp = out + ".tmp" + std::to_string(::getpid());
  module.save(tmp);
  if (std::rename(tmp.c_str(), out.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write " + out + ": " + std::strerror(errno));
  }
}

/// A TorchScript module tree of `m`'s shape holding `m`'s own tensors (so a
/// trace of `m` reads them as the module's attributes).
torch::jit::Module mirror_as_script(const torch::nn::Module& m, const std::string& type,
                                    const std::shared_ptr<torch::jit::CompilationUnit>& cu) {
  torch::jit::Module out(c10::QualifiedName("__torch__.fusetrain." + type), cu, /*shouldMangle=*/true);
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    out.register_parameter(p.key(), p.value(), /*is_buffer=*/false);
  }
  for (const auto& b : m.named_buffers(/*recurse=*/false)) out.register_buffer(b.key(), b.value());
  for (const auto& c : m.named_children()) {
    out.register_module(c.key(), mirror_as_script(*c.value(), "Part", cu));
  }
  return out;
}

}  // namespace

std::string export_traced_torchscript(const std::string& checkpoint, const std::string& out) {
  Config config = config_from_checkpoint(checkpoint);
  // The export is float32: a mixed_float8 run's model is rebuilt with plain
  // linear layers (load_model skips the float8 scaling state).
  config.set("precision.policy", "float32", "export");
  const TensorDict ckpt = read_checkpoint(checkpoint);
  const std::string& name = config.get_string("model.name");
  // The shapes the model was built for, as load_checkpoint.py reads them.
  Dataset shapes;
  const at::Tensor input_shape = checkpoint_entry(ckpt, "data.input_shape", checkpoint);
  shapes.input_shape.assign(input_shape.const_data_ptr<int64_t>(),
                            input_shape.const_data_ptr<int64_t>() + input_shape.numel());
  shapes.num_classes = checkpoint_entry(ckpt, "data.num_classes", checkpoint).item<int64_t>();
  shapes.is_tokens = name == "gpt";
  Model model = make_model(config, shapes);
  load_model(ckpt, checkpoint, model);
  model->set_fused_batch_norm(false);  // the trace must hold torch's ops only
  model->set_fused_max_pool(false);
  model->to(at::kFloat);  // master-weight runs keep 16-bit layers; the export is float32
  model->eval();

  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::Module script = mirror_as_script(*model, name == "gpt" ? "Gpt" : name == "cnn" ? "Cnn"
                                                             : name == "mlp" ? "Mlp" : "ResNet", cu);
  std::vector<int64_t> example_shape = {2};
  example_shape.insert(example_shape.end(), shapes.input_shape.begin(), shapes.input_shape.end());
  const at::Tensor example = shapes.is_tokens ? at::zeros(example_shape, at::kLong)
                                              : at::zeros(example_shape, at::kFloat);
  at::NoGradGuard no_grad;
  auto traced = torch::jit::tracer::trace(
      {example},
      [&](torch::jit::Stack in) -> torch::jit::Stack {
        return {model->forward_for_trace(in.at(0).toTensor())};
      },
      [](const at::Tensor&) { return std::string(); }, /*strict=*/true, /*force_outplace=*/false,
      &script);
  auto fn = cu->create_function(c10::QualifiedName(*script.type()->name(), "forward"),
                                traced.first->graph);
  script.type()->addMethod(fn);
  save_atomically(script, out);
  return name + " traced in eval mode, input [N" +
         std::string(shapes.is_tokens ? ", T <= " + std::to_string(config.get_int("model.seq_len")) + "] token ids"
                                      : ", " + c10::str(c10::IntArrayRef(shapes.input_shape)).substr(1)) +
         " -> logits";
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
  save_atomically(module, out);
}

}  // namespace fusetrain::trainer
