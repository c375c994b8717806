// Build facts of libfusetrain: its version and what it was compiled with.
#pragma once

#include <string>

namespace fusetrain {

/// fusetrain's version, e.g. "0.1.0".
std::string version();

/// True when the CUDA kernels were compiled into this libfusetrain.
bool compiled_with_cuda();

}  // namespace fusetrain
