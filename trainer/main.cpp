// The fusetrain command line: `train` (a whole run, one process or many),
// `eval` (a checkpoint on the test split) and `info` (build and machine).
//
// Exit codes: 0 success; 1 a failure while running (a rank crashed, I/O);
// 2 a usage, configuration or bad-input error found before any work
// (unknown key, bad value, missing dataset, corrupt checkpoint, too many
// processes); 130 stopped by Ctrl-C or SIGTERM after saving a checkpoint.
#include <fusetrain/fusetrain.h>

#include "checkpoint.h"
#include "config.h"
#include "evaluate.h"
#include "hf_models.h"
#include "launch.h"
#include "torchscript_model.h"
#include "tpu.h"
#include "train.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/version.h>

// --set values hold commas ("model.channels=16,32"): never split them.
#define CXXOPTS_VECTOR_DELIMITER '\0'
#include <cxxopts.hpp>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <unistd.h>

#ifndef FUSETRAIN_CONFIG_DIR
#define FUSETRAIN_CONFIG_DIR "configs"
#endif

namespace {

namespace ft = fusetrain::trainer;

constexpr int kUsageError = 2;

// Dedicated flags and the config keys they set.
const std::vector<std::pair<std::string, std::string>> kFlagKeys = {
    {"device", "runtime.device"},
    {"nproc", "runtime.nproc"},
    {"nnodes", "runtime.nnodes"},
    {"node-rank", "runtime.node_rank"},
    {"master-addr", "runtime.master_addr"},
    {"master-port", "runtime.master_port"},
    {"epochs", "train.epochs"},
    {"steps-per-execution", "train.steps_per_execution"},
    {"precision", "precision.policy"},
    {"threads", "runtime.threads"},
    {"seed", "train.seed"},
    {"run-dir", "output.run_dir"},
};

bool exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

/// A path as given, or the name of a shipped config ("tiny", "tiny.yaml").
std::string resolve_config_path(const std::string& name) {
  if (exists(name) || name.find('/') != std::string::npos) return name;
  for (const std::string& dir : {std::string("configs"), std::string(FUSETRAIN_CONFIG_DIR)}) {
    for (const std::string& ext : {std::string(""), std::string(".yaml")}) {
      if (exists(dir + "/" + name + ext)) return dir + "/" + name + ext;
    }
  }
  return name;
}

/// `text` in a file of a new private directory, both removed with this object.
class PrivateFile {
 public:
  PrivateFile(const std::string& name, const std::string& text) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/fusetrain-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("cannot create a private directory under " + pattern + ": " +
                               std::strerror(errno));
    }
    dir_ = pattern;
    path_ = dir_ + "/" + name;
    std::ofstream out(path_);
    out << text;
    if (!out.flush()) throw std::runtime_error("cannot write " + path_);
  }
  ~PrivateFile() {
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  PrivateFile(const PrivateFile&) = delete;
  PrivateFile& operator=(const PrivateFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string dir_, path_;
};

std::string rank_prefix() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank == nullptr || world == nullptr || std::string(world) == "1") return "";
  return std::string("[rank ") + rank + "] ";
}

int run_info() {
  std::cout << "fusetrain " << fusetrain::version() << "\n"
            << "torch " << TORCH_VERSION << "\n"
            << "CUDA kernels compiled: " << (fusetrain::compiled_with_cuda() ? "yes" : "no")
            << "\n"
            << "CUDA available: " << (torch::cuda::is_available() ? "yes" : "no") << "\n"
            << "CUDA devices: " << static_cast<int>(torch::cuda::device_count()) << "\n"
            << "NCCL: " << (torch::cuda::is_available() ? "yes" : "no (needs CUDA)") << "\n"
            << "gloo: yes\n"
            << "CPU cores available: " << ft::available_cores() << "\n"
            << "intra-op threads: " << at::get_num_threads() << "\n";
  const double busy = ft::busy_cores(std::chrono::milliseconds(250));
  if (busy >= 0) {
    std::cout << "CPU load from other work: about " << std::fixed << std::setprecision(1) << busy
              << std::defaultfloat << " of " << ft::available_cores() << " cores busy (a 0.25 s sample)\n";
    const std::string warning = ft::thread_load_warning(at::get_num_threads(), 1, busy);
    if (!warning.empty()) std::cout << "warning: " << warning << "\n";
  }
  const fusetrain::ops::CpuFeatures& cpu = fusetrain::ops::cpu_features();
  std::cout << "CPU: " << (cpu.model.empty() ? "unknown" : cpu.model) << "; vector path "
            << fusetrain::ops::cpu_path_name(fusetrain::ops::cpu_path()) << " (avx2 "
            << (cpu.avx2 ? "yes" : "no") << ", avx512 " << (cpu.avx512 ? "yes" : "no")
            << ", avx512_bf16 " << (cpu.avx512_bf16 ? "yes" : "no") << ", amx_bf16 "
            << (cpu.amx_bf16 ? "yes" : "no") << ")\n";
  const fusetrain::amp::Policy cpu_policy = fusetrain::amp::best_policy(c10::DeviceType::CPU);
  std::cout << "precision.policy auto on cpu: " << cpu_policy.name() << " (" << cpu_policy.reason()
            << ")\n";
  if (torch::cuda::is_available()) {
    const fusetrain::amp::Policy gpu = fusetrain::amp::best_policy(c10::DeviceType::CUDA);
    std::cout << "precision.policy auto on cuda: " << gpu.name() << " (" << gpu.reason() << ")\n";
  }
  if (const auto tpu = ft::find_torch_tpu()) {
    std::cout << "TPU: torch_tpu " << (tpu->version.empty() ? "(version unknown)" : tpu->version)
              << " at " << tpu->path
              << " (train on a TPU from Python: fusetrain's ops run there through their "
                 "device-generic kernels; this trainer runs on cpu and cuda)\n";
  } else {
    std::cout << "TPU: no (torch_tpu not installed beside torch: pip install \"fusetrain[tpu]\")\n";
  }
  return 0;
}

void print_usage() {
  std::cout << "fusetrain: fast mixed-precision, data-parallel training on LibTorch\n\n"
               "Usage: fusetrain COMMAND [OPTIONS]\n\n"
               "Commands:\n"
               "  train   train a model: fusetrain train --config configs/fashion_mnist.yaml\n"
               "  eval    evaluate a checkpoint: fusetrain eval --checkpoint PATH\n"
               "  export  a checkpoint's model for Python: fusetrain export --checkpoint PATH "
               "--state-dict OUT.pt\n"
               "  info    versions, devices, threads\n\n"
               "fusetrain COMMAND --help shows the command's options.\n"
               "Exit codes: 0 done, 1 failed while running, 2 usage/config/input error, "
               "130 interrupted (checkpoint saved).\n";
}

int run_train(int argc, char** argv) {
  cxxopts::Options options("fusetrain train", "Train a model from a YAML run configuration.");
  options.add_options()
      ("c,config", "run configuration: a YAML file, or the name of one in configs/",
       cxxopts::value<std::string>()->default_value("fashion_mnist"))
      ("set", "override a configuration key, e.g. --set optimizer.lr=3e-4 (repeatable)",
       cxxopts::value<std::vector<std::string>>())
      ("device", "runtime.device: cpu or cuda", cxxopts::value<std::string>())
      ("nproc", "runtime.nproc: local data-parallel processes to spawn", cxxopts::value<std::string>())
      ("nnodes", "runtime.nnodes: hosts of the run, each running fusetrain train with the same "
                 "config", cxxopts::value<std::string>())
      ("node-rank", "runtime.node_rank: this host's index, 0 .. nnodes-1",
       cxxopts::value<std::string>())
      ("master-addr", "runtime.master_addr: host 0's address, where the rendezvous store is "
                      "hosted", cxxopts::value<std::string>())
      ("master-port", "runtime.master_port: the rendezvous store's port on host 0",
       cxxopts::value<std::string>())
      ("epochs", "train.epochs", cxxopts::value<std::string>())
      ("steps-per-execution",
       "train.steps_per_execution: steps per execution (one CUDA graph on cuda)",
       cxxopts::value<std::string>())
      ("precision", "precision.policy: auto, float32, mixed_float16, mixed_bfloat16 or mixed_float8",
       cxxopts::value<std::string>())
      ("threads", "runtime.threads: intra-op threads per process (0: cores / processes)",
       cxxopts::value<std::string>())
      ("seed", "train.seed", cxxopts::value<std::string>())
      ("run-dir", "output.run_dir: where the run's files go", cxxopts::value<std::string>())
      ("resume", "continue from a checkpoint: PATH, or auto (the newest checkpoint of the newest "
                 "run of this config, or a fresh start when there is none)",
       cxxopts::value<std::string>())
      ("print-config", "print the resolved configuration and exit")
      ("list-keys", "list every configuration key with its default and accepted values")
      ("print-schema", "print the configuration schema as JSON (key, type, default, accepted "
                       "values, meaning) and exit")
      ("config-name", "name of the run's configuration (set by the launcher for its ranks)",
       cxxopts::value<std::string>())
      ("h,help", "show this help");
  const auto args = options.parse(argc, argv);
  if (args.count("help")) {
    std::cout << options.help()
              << "\nEvery configuration key can be set with --set; --list-keys lists them.\n";
    return 0;
  }
  if (!args.unmatched().empty()) {
    throw ft::UsageError("unexpected argument \"" + args.unmatched().front() + "\"");
  }
  if (args.count("print-schema")) {
    std::cout << ft::schema_json();
    return 0;
  }
  if (args.count("list-keys")) {
    std::cout << "Configuration keys (section.key = default  meaning; accepted values):\n"
              << ft::describe_schema();
    return 0;
  }

  const std::string resume = args.count("resume") ? args["resume"].as<std::string>() : "";
  ft::Config config;
  if (!resume.empty() && resume != "auto" && !args.count("config")) {
    // Resuming a checkpoint without a config file: the run's own config.
    if (!exists(resume)) throw ft::UsageError("--resume " + resume + ": no such checkpoint file");
    config = ft::config_from_checkpoint(resume);
  } else {
    config = ft::Config::from_file(resolve_config_path(args["config"].as<std::string>()));
  }
  if (args.count("config-name")) config.set_name(args["config-name"].as<std::string>());
  for (const auto& [flag, key] : kFlagKeys) {
    if (args.count(flag)) config.set(key, args[flag].as<std::string>(), "--" + flag);
  }
  if (args.count("set")) {
    for (const auto& s : args["set"].as<std::vector<std::string>>()) config.apply_override(s);
  }
  ft::resolve_auto_policy(config);
  if (args.count("print-config")) {
    std::cout << config.to_yaml();
    return 0;
  }

  std::optional<fusetrain::dist::Environment> env;
  try {
    env = fusetrain::dist::Environment::from_env();
  } catch (const c10::Error& e) {
    throw ft::UsageError(e.what_without_backtrace());
  }
  const int timeout_s = static_cast<int>(config.get_int("runtime.timeout_s"));
  const c10::DeviceType device_type = config.get_string("runtime.device") == "cuda"
                                          ? c10::DeviceType::CUDA
                                          : c10::DeviceType::CPU;
  if (env.has_value()) {
    // Launched as one rank of a group (by our launcher, torchrun or a
    // scheduler): join it.
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    const int local_world = local ? std::max(1, std::atoi(local)) : env->world_size;
    at::set_num_threads(ft::threads_for(config, local_world));
    ft::check_before_start(config, env->world_size, local_world);
    std::string resume_as = resume;
    const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (resume_as.empty() && restarts != nullptr && std::atoi(restarts) > 0) {
      // torchrun restarted the group after a failure: go on from the newest
      // checkpoint rather than train again from the start.
      resume_as = "auto";
    }
    ft::Distributed world(*env, device_type, std::chrono::seconds(timeout_s),
                          config.get_bool("parallel.shared_memory"));
    try {
      world.learn_peer_addresses();
      ft::check_same_config(config, world);
      const ft::RunPlan plan = ft::agree_on_plan(config, resume_as, world);
      return ft::run_training(config, plan, world);
    } catch (const ft::UsageError&) {
      throw;
    } catch (const ft::CheckpointError&) {
      throw;
    } catch (const c10::Error& e) {
      throw std::runtime_error(world.explain_failure(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      throw std::runtime_error(world.explain_failure(e.what()));
    }
  }
  ft::LaunchSpec spec;
  spec.nproc = static_cast<int>(config.get_int("runtime.nproc"));
  spec.nnodes = static_cast<int>(config.get_int("runtime.nnodes"));
  spec.node_rank = static_cast<int>(config.get_int("runtime.node_rank"));
  spec.master_addr = config.get_string("runtime.master_addr");
  spec.master_port = static_cast<int>(config.get_int("runtime.master_port"));
  spec.timeout = std::chrono::seconds(timeout_s);
  if (spec.node_rank >= spec.nnodes) {
    throw config.error("runtime.node_rank", "must be below runtime.nnodes=" +
                                                std::to_string(spec.nnodes));
  }
  if (spec.nnodes > 1 && spec.master_port == 0) {
    throw config.error("runtime.master_port", "a run on several hosts needs the port host 0 "
                                              "hosts its store on, the same on every host "
                                              "(e.g. --master-port 29500)");
  }
  const int world_size = spec.nnodes * spec.nproc;
  ft::check_before_start(config, world_size, spec.nproc);
  if (world_size == 1) {
    const ft::RunPlan plan = ft::plan_run(config, resume);
    at::set_num_threads(ft::threads_for(config, 1));
    return ft::run_training(config, plan, ft::Distributed());
  }
  // The ranks read this host's resolved config from a private file; rank 0
  // creates the run directory once the data has loaded, so bad input leaves
  // nothing behind.
  std::vector<std::string> child = {"train", "--config-name", config.name()};
  if (spec.node_rank == 0) {
    // Host 0 plans the run (its ranks agree on rank 0's plan), so a bad
    // checkpoint fails here before any process starts.
    const ft::RunPlan plan = ft::plan_run(config, resume);
    if (!plan.checkpoint.empty()) child.insert(child.end(), {"--resume", plan.checkpoint});
  }
  const std::string& policy_origin = config.origin("precision.policy");
  if (spec.node_rank == 0 && policy_origin.rfind("auto: ", 0) == 0) {
    // The ranks read the resolved name; the reason is said here, once.
    std::cout << "precision.policy auto -> " << config.get_string("precision.policy") << ": "
              << policy_origin.substr(6) << "\n";
  }
  const PrivateFile file("config.yaml", config.to_yaml());
  child.insert(child.end(), {"--config", file.path()});
  return ft::spawn_local_ranks(child, spec);
}

/// The command's arguments; nullopt after printing --help. Positional
/// leftovers are a usage error.
std::optional<cxxopts::ParseResult> parse_command(cxxopts::Options& options, int argc, char** argv) {
  auto args = options.parse(argc, argv);
  if (args.count("help")) {
    std::cout << options.help();
    return std::nullopt;
  }
  if (!args.unmatched().empty()) {
    throw ft::UsageError("unexpected argument \"" + args.unmatched().front() + "\"");
  }
  return args;
}

int run_export(int argc, char** argv) {
  cxxopts::Options options("fusetrain export",
                           "Write a checkpoint's trained model for Python: a state dict "
                           "(Module.load_state_dict), a Hugging Face folder (gpt2, llama) or a "
                           "TorchScript file (torch.jit.load; deprecated).");
  options.add_options()
      ("checkpoint", "checkpoint written by fusetrain train", cxxopts::value<std::string>())
      ("state-dict", "write the model's parameters and buffers, by their names, to this file",
       cxxopts::value<std::string>())
      ("torchscript", "write the trained model as a TorchScript module to this file (the run's own "
                      "module for model.name=torchscript; a trace in eval mode for the built-in models)",
       cxxopts::value<std::string>())
      ("hf", "gpt2, llama: write a Hugging Face model folder (config.json, model.safetensors) that "
             "transformers.AutoModelForCausalLM.from_pretrained loads", cxxopts::value<std::string>())
      ("h,help", "show this help");
  const auto parsed = parse_command(options, argc, argv);
  if (!parsed) return 0;  // --help
  const auto& args = *parsed;
  if (!args.count("checkpoint")) throw ft::UsageError("export needs --checkpoint PATH");
  if (!args.count("state-dict") && !args.count("torchscript") && !args.count("hf")) {
    throw ft::UsageError("export needs --state-dict OUT.pt, --torchscript OUT.pt or --hf OUT_DIR");
  }
  const std::string checkpoint = args["checkpoint"].as<std::string>();
  if (!exists(checkpoint)) throw ft::UsageError("--checkpoint " + checkpoint + ": no such file");
  const ft::TensorDict ckpt = ft::read_checkpoint(checkpoint);
  const ft::Config config = ft::config_from_checkpoint(checkpoint);
  if (args.count("state-dict")) {
    ft::TensorDict state;
    for (const auto& [key, t] : ckpt) {
      // A mixed_float8 run's scaling state (".fp8_*" buffers) is training
      // state: the export loads into the float32 torch.nn.Module.
      if (key.rfind("model.", 0) == 0 && key.find(".fp8_") == std::string::npos) {
        state.emplace_back(key.substr(6), t);
      }
    }
    const std::string out = args["state-dict"].as<std::string>();
    ft::write_tensor_dict(out, state);
    std::cout << "state dict of " << state.size() << " tensors -> " << out << "\n";
  }
  if (args.count("hf")) {
    const std::string out = args["hf"].as<std::string>();
    const std::string what = ft::export_hf(checkpoint, out);
    std::cout << "Hugging Face model (" << what << ") -> " << out << "\n";
  }
  if (args.count("torchscript") && config.get_string("model.name") != "torchscript") {
    const std::string out = args["torchscript"].as<std::string>();
    const std::string what = ft::export_traced_torchscript(checkpoint, out);
    std::cout << "TorchScript module (" << what << ") -> " << out << "\n";
  } else if (args.count("torchscript")) {
    const std::string out = args["torchscript"].as<std::string>();
    ft::export_torchscript(checkpoint, config.get_string("model.path"), out);
    std::cout << "TorchScript module (" << config.get_string("model.path") << ", trained) -> "
              << out << "\n";
  }
  return 0;
}

int run_eval_command(int argc, char** argv) {
  cxxopts::Options options("fusetrain eval", "Evaluate a checkpoint on its test split.");
  options.add_options()
      ("checkpoint", "checkpoint written by fusetrain train", cxxopts::value<std::string>())
      ("set", "override a configuration key of the checkpoint's config (repeatable)",
       cxxopts::value<std::vector<std::string>>())
      ("device", "runtime.device: cpu or cuda", cxxopts::value<std::string>())
      ("precision", "precision.policy to evaluate in", cxxopts::value<std::string>())
      ("predictions", "also write the logits and targets to this file (torch.load reads it)",
       cxxopts::value<std::string>())
      ("h,help", "show this help");
  const auto parsed = parse_command(options, argc, argv);
  if (!parsed) return 0;  // --help
  const auto& args = *parsed;
  if (!args.count("checkpoint")) throw ft::UsageError("eval needs --checkpoint PATH");
  std::vector<std::string> overrides;
  if (args.count("device")) overrides.push_back("runtime.device=" + args["device"].as<std::string>());
  if (args.count("precision")) {
    overrides.push_back("precision.policy=" + args["precision"].as<std::string>());
  }
  if (args.count("set")) {
    for (const auto& s : args["set"].as<std::vector<std::string>>()) overrides.push_back(s);
  }
  at::set_num_threads(ft::available_cores());
  return ft::run_eval(args["checkpoint"].as<std::string>(), overrides,
                      args.count("predictions") ? args["predictions"].as<std::string>() : "");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage();
    return kUsageError;
  }
  const std::string command = argv[1];
  try {
    if (command == "-h" || command == "--help" || command == "help") {
      print_usage();
      return 0;
    }
    if (command == "info") return run_info();
    if (command == "train") return run_train(argc - 1, argv + 1);
    if (command == "eval") return run_eval_command(argc - 1, argv + 1);
    if (command == "export") return run_export(argc - 1, argv + 1);
    std::cerr << "fusetrain: unknown command \"" << command << "\"; run fusetrain --help\n";
    return kUsageError;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "fusetrain " << command << ": " << e.what() << " (see fusetrain " << command
              << " --help)\n";
    return kUsageError;
  } catch (const ft::UsageError& e) {
    std::cerr << rank_prefix() << "fusetrain " << command << ": error: " << e.what() << "\n";
    return kUsageError;
  } catch (const ft::CheckpointError& e) {
    std::cerr << rank_prefix() << "fusetrain " << command << ": error: " << e.what() << "\n";
    return kUsageError;
  } catch (const c10::Error& e) {
    std::cerr << rank_prefix() << "fusetrain " << command << ": " << e.what_without_backtrace()
              << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << rank_prefix() << "fusetrain " << command << ": " << e.what() << "\n";
    return 1;
  }
}
