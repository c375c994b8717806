// Process groups from the torchrun environment: a c10d::TCPStore rendezvous,
// then torch's own gloo (CPU) or NCCL (CUDA) backend on it.
#include <fusetrain/dist/process_group.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FUSETRAIN_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace fusetrain::dist {

namespace {

std::optional<std::string> get_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, const std::string& value, int lo, int hi) {
  size_t used = 0;
  int parsed = 0;
  try {
    parsed = std::stoi(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK_VALUE(used == value.size() && parsed >= lo && parsed <= hi, "environment variable ",
                    name, "=\"", value, "\" must be an integer in [", lo, ", ", hi, "]");
  return parsed;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace

std::optional<Environment> Environment::from_env() {
  const auto rank = get_env("RANK");
  const auto world = get_env("WORLD_SIZE");
  if (!rank.has_value() || !world.has_value()) return std::nullopt;
  Environment env;
  env.world_size = env_int("WORLD_SIZE", *world, 1, 1 << 20);
  env.rank = env_int("RANK", *rank, 0, env.world_size - 1);
  env.local_rank = env_int("LOCAL_RANK", get_env("LOCAL_RANK").value_or(std::to_string(env.rank)),
                           0, env.world_size - 1);
  env.master_addr = get_env("MASTER_ADDR").value_or("127.0.0.1");
  env.master_port = env_int("MASTER_PORT", get_env("MASTER_PORT").value_or("29500"), 1, 65535);
  const std::string agent = get_env("TORCHELASTIC_USE_AGENT_STORE").value_or("");
  env.agent_store = agent == "True" || agent == "true" || agent == "1";
  return env;
}

bool gloo_available() { return true; }

bool nccl_available() {
#ifdef FUSETRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "free_port: cannot create a socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "free_port: cannot bind a loopback socket");
  return ntohs(addr.sin_port);
}

StoreHost::StoreHost(std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = 0;  // the kernel picks one, and the server keeps it bound
  options.isServer = true;
  options.waitWorkers = false;
  options.timeout = timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", options);
  port_ = store->getPort();
  store_ = std::move(store);
}

StoreHost::~StoreHost() = default;

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const Environment& env,
                                                          const ProcessGroupOptions& options) {
  std::string backend = options.backend;
  if (backend == "auto") backend = options.device_type == c10::DeviceType::CUDA ? "nccl" : "gloo";
  TORCH_CHECK_VALUE(backend == "gloo" || backend == "nccl", "init_process_group: backend must be "
                    "\"gloo\", \"nccl\" or \"auto\", got \"", backend, "\"");
  TORCH_CHECK(backend != "nccl" || nccl_available(),
              "init_process_group: NCCL needs a CUDA build of fusetrain");

  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0 && !env.agent_store;
  store_options.numWorkers = env.world_size;
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", env.rank, " could not join the rendezvous at ", env.master_addr,
                ":", env.master_port, " within ", options.timeout.count(), " ms: ", e.what());
  }

  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, env.rank, env.world_size);
  if (backend == "gloo") {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    gloo_options->devices.push_back(
        is_loopback(env.master_addr) ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                     : c10d::ProcessGroupGloo::createDefaultDevice());
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", store), env.rank, env.world_size,
        gloo_options);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  } else {
#ifdef FUSETRAIN_WITH_CUDA
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = options.timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", store), env.rank, env.world_size,
        nccl_options);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#endif
  }
  return group;
}

}  // namespace fusetrain::dist
