#include "tpu.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace fusetrain::trainer {

namespace {

namespace fs = std::filesystem;

// The site-packages directory of the libtorch this process loaded
// (site-packages/torch/lib/libtorch_cpu.so), or empty.
std::string torch_site_packages() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const fs::path lib = line.substr(slash);
    if (lib.filename() == "libtorch_cpu.so") return lib.parent_path().parent_path().parent_path();
  }
  return {};
}

// "1.2.3" from a "torch_tpu-1.2.3.dist-info" directory beside the package.
std::string dist_info_version(const fs::path& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string prefix = "torch_tpu-", suffix = ".dist-info";
    if (name.size() > prefix.size() + suffix.size() && name.rfind(prefix, 0) == 0 &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    }
  }
  return {};
}

}  // namespace

std::optional<TorchTpuPackage> find_torch_tpu() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("PYTHONPATH")) {
    std::stringstream parts(env);
    std::string part;
    while (std::getline(parts, part, ':')) {
      if (!part.empty()) dirs.push_back(part);
    }
  }
  if (std::string site = torch_site_packages(); !site.empty()) dirs.push_back(site);
  for (const std::string& dir : dirs) {
    std::error_code ec;
    const fs::path package = fs::path(dir) / "torch_tpu";
    if (fs::is_regular_file(package / "__init__.py", ec)) {
      return TorchTpuPackage{package.string(), dist_info_version(dir)};
    }
  }
  return std::nullopt;
}

}  // namespace fusetrain::trainer
