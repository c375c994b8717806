// Whether torch_tpu (torch's TPU backend, a Python package) is installed
// where this process's torch is: `fusetrain info` reports it. The trainer
// itself trains on CPUs and CUDA GPUs; a TPU is trained on from Python, where
// fusetrain's ops run through their device-generic kernels.
#pragma once

#include <optional>
#include <string>

namespace fusetrain::trainer {

struct TorchTpuPackage {
  std::string path;     ///< the torch_tpu package directory
  std::string version;  ///< from its .dist-info directory; empty if none
};

/// torch_tpu as Python would import it beside this process's torch: the
/// directories of PYTHONPATH first, then the site-packages holding the
/// loaded libtorch_cpu.so (read from /proc/self/maps). nullopt if in none.
std::optional<TorchTpuPackage> find_torch_tpu();

}  // namespace fusetrain::trainer
