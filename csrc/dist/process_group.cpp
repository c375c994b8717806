// Process groups from the torchrun environment: a c10d::TCPStore rendezvous,
// then torch's own gloo (CPU) or NCCL (CUDA) backend on it.
#include <fusetrain/dist/process_group.h>
#include <fusetrain/dist/shared_memory.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FUSETRAIN_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

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

// The addresses `host` resolves to, for TCP; an error naming `what` when none.
std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> resolve(const std::string& host, int port,
                                                             const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  TORCH_CHECK(rc == 0 && found != nullptr, what, "=", host, " does not resolve to an address: ",
              ::gai_strerror(rc));
  return {found, &::freeaddrinfo};
}

std::string address_text(const sockaddr* addr) {
  char buf[INET6_ADDRSTRLEN] = {};
  const void* raw = addr->sa_family == AF_INET6
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(addr)->sin_addr);
  return ::inet_ntop(addr->sa_family, raw, buf, sizeof(buf)) ? std::string(buf) : std::string();
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    if (end > begin) out.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

// A TCP socket bound to `host`:`port` (0: the kernel picks) and listening,
// for a TCPStore server to take over: it serves that address only, not
// every interface of the machine.
int listen_on(const std::string& host, int port, const std::string& what) {
  const auto found = resolve(host, port, what);
  std::string last_error;
  for (const addrinfo* a = found.get(); a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) return fd;
    last_error = std::strerror(errno);
    ::close(fd);
  }
  TORCH_CHECK(false, "cannot host the rendezvous store at ", host, ":", port, ": ", last_error,
              " (is the port in use, or the address not one of this host's?)");
}

int bound_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  TORCH_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
              "getsockname failed: ", std::strerror(errno));
  return ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

std::string local_address_towards(const std::string& host, int port) {
  const auto found = resolve(host, port, "MASTER_ADDR");
  for (const addrinfo* a = found.get(); a != nullptr; a = a->ai_next) {
    // Connecting a UDP socket sends nothing: it only asks the kernel's
    // routing table which source address reaches `host`.
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    const bool ok = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    ::close(fd);
    if (ok) return address_text(reinterpret_cast<const sockaddr*>(&local));
  }
  TORCH_CHECK(false, "no route from this host to MASTER_ADDR=", host);
}

GlooTransport gloo_transport_for(const std::string& master_addr, int master_port) {
  GlooTransport t;
  if (const auto ifnames = get_env("GLOO_SOCKET_IFNAME")) {
    t.interfaces = split_commas(*ifnames);
    TORCH_CHECK_VALUE(!t.interfaces.empty(), "GLOO_SOCKET_IFNAME=\"", *ifnames,
                      "\" names no network interface");
  } else {
    t.address = local_address_towards(master_addr, master_port);
  }
  return t;
}

std::string GlooTransport::describe() const {
  if (interfaces.empty()) return "address " + address + " (the one that routes to MASTER_ADDR)";
  std::string names;
  for (const auto& i : interfaces) names += (names.empty() ? "" : ",") + i;
  return "interface" + std::string(interfaces.size() > 1 ? "s " : " ") + names +
         " (GLOO_SOCKET_IFNAME)";
}

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
  env.restart_count = env_int("TORCHELASTIC_RESTART_COUNT",
                              get_env("TORCHELASTIC_RESTART_COUNT").value_or("0"), 0, 1 << 30);
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

StoreHost::StoreHost(std::chrono::milliseconds timeout, const std::string& host, int port) {
  const int fd = listen_on(host, port, "the store address");
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(bound_port(fd));
  options.isServer = true;
  options.waitWorkers = false;
  options.timeout = timeout;
  options.masterListenFd = fd;  // the server takes the socket over
  auto store = c10::make_intrusive<c10d::TCPStore>(host, options);
  port_ = options.port;
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

  // gloo's devices first: a bad GLOO_SOCKET_IFNAME fails every rank on its
  // own, before a rank that has already left could strand the others in
  // the rendezvous. Not ProcessGroupGloo::createDefaultDevice(): it binds
  // the address the hostname resolves to, a loopback one on many hosts
  // (Debian maps the name to 127.0.1.1), which peers on other hosts cannot
  // reach.
  std::optional<GlooTransport> transport;
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  if (backend == "gloo") {
    transport = gloo_transport_for(env.master_addr, env.master_port);
    try {
      for (const auto& name : transport->interfaces) {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
      }
      if (transport->interfaces.empty()) {
        gloo_options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForHostname(transport->address));
      }
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, ": gloo cannot use ", transport->describe(), ": ",
                  e.what());
    }
  }

  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0 && !env.agent_store;
  store_options.numWorkers = env.world_size;
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout;
  if (store_options.isServer) {
    // Serve MASTER_ADDR only, as the address the ranks were told.
    store_options.masterListenFd = listen_on(env.master_addr, env.master_port, "MASTER_ADDR");
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", env.rank, " could not join the rendezvous at ", env.master_addr,
                ":", env.master_port, " within ", options.timeout.count(), " ms: ", e.what());
  }

  if (env.agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>(
        "/worker/attempt_" + std::to_string(env.restart_count), store);
  }
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, env.rank, env.world_size);
  if (backend == "gloo") {
    c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
    try {
      gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("gloo", store), env.rank, env.world_size,
          gloo_options);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, " could not connect to its peers over gloo from ",
                  transport->describe(), "; set GLOO_SOCKET_IFNAME to the interface that reaches "
                  "the other hosts: ", e.what());
    }
    c10::intrusive_ptr<c10d::Backend> cpu = gloo;
    if (options.shared_memory) {
      if (auto shm = make_shared_memory_backend(store, env.rank, env.world_size, options.timeout, gloo)) {
        cpu = std::move(shm);
      }
    }
    // Labelled gloo either way: every collective but the dense allreduces is gloo's.
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, cpu);
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
