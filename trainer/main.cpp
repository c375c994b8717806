// The fusetrain command line. `fusetrain info` reports the build and the
// machine; training subcommands arrive with the trainer.
#include <fusetrain/fusetrain.h>

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <cxxopts.hpp>

#include <iostream>

namespace {

int run_info() {
  std::cout << "fusetrain " << fusetrain::version() << "\n"
            << "torch " << TORCH_VERSION << "\n"
            << "CUDA kernels compiled: " << (fusetrain::compiled_with_cuda() ? "yes" : "no")
            << "\n"
            << "CUDA available: " << (torch::cuda::is_available() ? "yes" : "no") << "\n"
            << "CUDA devices: " << static_cast<int>(torch::cuda::device_count()) << "\n"
            << "NCCL: " << (torch::cuda::is_available() ? "yes" : "no (needs CUDA)") << "\n"
            << "gloo: yes\n"
            << "intra-op threads: " << at::get_num_threads() << "\n";
  return 0;
}

void print_usage(const cxxopts::Options& options) {
  std::cout << options.help() << "\nCommands:\n  info    versions, devices, threads\n";
}

}  // namespace

int main(int argc, char** argv) {
  cxxopts::Options options("fusetrain", "fast mixed-precision, data-parallel training on LibTorch");
  options.add_options()("h,help", "show this help")(
      "command", "the command to run", cxxopts::value<std::string>());
  options.parse_positional({"command"});
  options.positional_help("COMMAND");
  try {
    const auto args = options.parse(argc, argv);
    if (args.count("help") || !args.count("command")) {
      print_usage(options);
      return args.count("help") ? 0 : 2;
    }
    const std::string command = args["command"].as<std::string>();
    if (command == "info") return run_info();
    std::cerr << "fusetrain: unknown command \"" << command << "\"; run fusetrain --help\n";
    return 2;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "fusetrain: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fusetrain: " << e.what() << "\n";
    return 1;
  }
}
