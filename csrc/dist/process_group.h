// Process groups for data parallelism: torch.distributed's own c10d groups
// (gloo on CPUs, NCCL on GPUs) created from the torchrun environment through
// a TCP store, with a timeout on every collective.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace fusetrain::dist {

/// The torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
struct Environment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// TORCHELASTIC_USE_AGENT_STORE=True: the store is hosted already
  /// (torchrun's agent, or StoreHost in fusetrain's launcher), and rank 0
  /// joins it as a client instead of hosting it.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the group. The
  /// agent's store outlives a restart, so each attempt keeps its keys under
  /// its own prefix ("/worker/attempt_N", torch.distributed's convention):
  /// a new rank must not read a dead one's address.
  int restart_count = 0;

  /// Reads the variables; nullopt when RANK or WORLD_SIZE is unset. A
  /// malformed or out-of-range value is an error naming the variable.
  static std::optional<Environment> from_env();
};

struct ProcessGroupOptions {
  /// "gloo", "nccl", or "auto" (nccl for CUDA, gloo for CPU).
  std::string backend = "auto";
  /// Device the group serves; picks the backend under "auto".
  c10::DeviceType device_type = c10::DeviceType::CPU;
  /// Bound on the store rendezvous and on every collective.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// gloo: when every rank is on this host, allreduce dense CPU tensors
  /// through shared memory instead of TCP (Note [Shared-memory allreduce]).
  bool shared_memory = true;
};

/// Creates the group for `env`: rank 0 hosts a c10d::TCPStore at
/// master_addr:master_port, every rank joins it, and the backend is built on it.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const Environment& env,
                                                          const ProcessGroupOptions& options = {});

/// A free TCP port on the loopback interface, found by binding and closing
/// a socket: another process may take it before it is used. Tests only; a
/// launcher hosts its store with StoreHost.
int free_port();

/// Where gloo's transport binds: the interfaces GLOO_SOCKET_IFNAME names
/// (comma-separated, one device each, as torch.distributed does), else the
/// local address the routing table uses towards MASTER_ADDR.
struct GlooTransport {
  std::vector<std::string> interfaces;
  std::string address;
  std::string describe() const;
};
GlooTransport gloo_transport_for(const std::string& master_addr, int master_port);

/// This host's source address for traffic to `host` (the routing table's
/// choice; nothing is sent). An error when `host` does not resolve.
std::string local_address_towards(const std::string& host, int port);

/// Hosts a c10d::TCPStore server for ranks that join it as clients
/// (Environment::agent_store, as torchrun's agent does), on a socket bound to
/// `host` only (never every interface) and kept bound: port 0 lets the
/// kernel pick one, so no other process can take it in between.
class StoreHost {
 public:
  explicit StoreHost(std::chrono::milliseconds timeout = std::chrono::minutes(5),
                     const std::string& host = "127.0.0.1", int port = 0);
  ~StoreHost();
  StoreHost(const StoreHost&) = delete;
  StoreHost& operator=(const StoreHost&) = delete;
  int port() const { return port_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int port_ = 0;
};

/// Whether this build can create NCCL groups (CUDA build with NCCL).
bool nccl_available();
/// Whether this build can create gloo groups.
bool gloo_available();

}  // namespace fusetrain::dist
