// Build facts of libfusetrain.
#include <fusetrain/version.h>

namespace fusetrain {

std::string version() { return FUSETRAIN_VERSION; }

bool compiled_with_cuda() {
#ifdef FUSETRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace fusetrain
