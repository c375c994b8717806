// Local rank spawning, stop signals, and the trainer's view of a process group.
#include "launch.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>  // PATH_MAX
#include <cstring>
#include <iostream>
#include <algorithm>
#include <vector>
#include <string>
#include <cctype>
#include <thread>
#include <sstream>
#include <fstream>
#include <map>
#include <optional>

extern char** environ;

namespace fusetrain::trainer {

namespace {

volatile sig_atomic_t g_stop = 0;
volatile sig_atomic_t g_parent_signal = 0;

void on_stop_signal(int sig) {
  if (g_stop && sig == SIGINT) {
    // A second Ctrl-C: the user does not want to wait for the checkpoint.
    constexpr char kMsg[] = "\nfusetrain: interrupted again, exiting without a checkpoint\n";
    (void)!::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
    ::_exit(130);
  }
  g_stop = 1;
}

void on_parent_signal(int sig) { g_parent_signal = sig; }

void set_handler(int sig, void (*fn)(int), bool restart) {
  struct sigaction sa {};
  sa.sa_handler = fn;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = restart ? SA_RESTART : 0;
  ::sigaction(sig, &sa, nullptr);
}

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot locate the fusetrain executable (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           ::strsignal(WTERMSIG(status)) + ")";
  }
  return "stopped";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

void install_stop_handlers() {
  set_handler(SIGINT, on_stop_signal, true);
  set_handler(SIGTERM, on_stop_signal, true);
}

bool stop_requested() { return g_stop != 0; }

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

namespace {

// Per CPU of this process's affinity mask: {busy, total} jiffies from
// /proc/stat (busy: all but idle and iowait). Empty where it cannot be read.
std::vector<std::pair<double, double>> cpu_jiffies() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const bool masked = ::sched_getaffinity(0, sizeof(set), &set) == 0;
  std::ifstream in("/proc/stat");
  std::vector<std::pair<double, double>> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || !std::isdigit(static_cast<unsigned char>(line[3]))) {
      continue;
    }
    std::istringstream fields(line.substr(3));
    int cpu = 0;
    fields >> cpu;
    double v = 0, total = 0, idle = 0;
    for (int i = 0; fields >> v; ++i) {
      if (i >= 8) break;  // guest time is already in user and nice
      total += v;
      if (i == 3 || i == 4) idle += v;  // idle, iowait
    }
    if (!masked || (cpu < CPU_SETSIZE && CPU_ISSET(cpu, &set))) out.emplace_back(total - idle, total);
  }
  return out;
}

}  // namespace

double busy_cores(std::chrono::milliseconds window) {
  const auto before = cpu_jiffies();
  std::this_thread::sleep_for(window);
  const auto after = cpu_jiffies();
  if (before.empty() || before.size() != after.size()) return -1.0;
  double busy = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    const double total = after[i].second - before[i].second;
    if (total > 0) busy += (after[i].first - before[i].first) / total;
  }
  return busy;
}

std::string thread_load_warning(int threads, int ranks, double busy) {
  const int cores = available_cores();
  const double free = std::max(0.0, cores - busy);
  const int wanted = threads * ranks;
  // Half a core of slack: a sample of a quarter second is noisy.
  if (busy < 0 || wanted <= free + 0.5) return "";
  const int fits = std::max(1, static_cast<int>(free / std::max(1, ranks)));
  std::ostringstream out;
  out.precision(2);
  out << "other work keeps about " << busy << " of the " << cores << " cores busy, leaving fewer "
      << "than the " << wanted << " intra-op thread" << (wanted == 1 ? "" : "s") << " of this run"
      << (ranks > 1 ? " (" + std::to_string(ranks) + " processes)" : std::string()) << " need; on a "
      << "busy machine fewer threads run faster (two on a busy 2-core machine ran 3.8x slower "
      << "than one): ";
  if (threads > fits) {
    out << "--threads " << fits;
  } else {
    out << "--threads is already " << threads << "; fewer processes (--nproc) or a quieter machine";
  }
  return out.str();
}

int spawn_local_ranks(const std::vector<std::string>& args, const LaunchSpec& spec) {
  const std::string exe = self_exe();
  const int nproc = spec.nproc;
  // Host 0's store lives here, on a port it keeps bound, and every rank joins
  // it as a client (as under torchrun's agent): rank 0 hosting it on a port
  // found free a moment earlier could lose that port to another process.
  std::optional<dist::StoreHost> store;
  if (spec.node_rank == 0) store.emplace(spec.timeout, spec.master_addr, spec.master_port);
  const int port = store ? store->port() : spec.master_port;
  static const char* kOwned[] = {"RANK=",        "WORLD_SIZE=",  "LOCAL_RANK=",
                                 "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT=",
                                 "TORCHELASTIC_USE_AGENT_STORE=", "GROUP_RANK=",
                                 "FUSETRAIN_BUSY_CORES="};
  // The machine's load before the ranks add theirs, for their header.
  const double busy = busy_cores(std::chrono::milliseconds(250));

  // Everything exec needs is built before fork: the child may only call
  // async-signal-safe functions, and this process may already run threads.
  std::vector<std::string> argv_s = {exe};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::vector<std::string>> env_s(nproc);
  std::vector<std::vector<char*>> envp(nproc);
  for (int r = 0; r < nproc; ++r) {
    for (char** e = environ; *e != nullptr; ++e) {
      bool owned = false;
      for (const char* k : kOwned) owned = owned || std::strncmp(*e, k, std::strlen(k)) == 0;
      if (!owned) env_s[r].emplace_back(*e);
    }
    env_s[r].push_back("RANK=" + std::to_string(spec.node_rank * nproc + r));
    env_s[r].push_back("WORLD_SIZE=" + std::to_string(spec.nnodes * nproc));
    env_s[r].push_back("LOCAL_RANK=" + std::to_string(r));
    env_s[r].push_back("LOCAL_WORLD_SIZE=" + std::to_string(nproc));
    env_s[r].push_back("GROUP_RANK=" + std::to_string(spec.node_rank));
    env_s[r].push_back("MASTER_ADDR=" + spec.master_addr);
    env_s[r].push_back("MASTER_PORT=" + std::to_string(port));
    env_s[r].push_back("TORCHELASTIC_USE_AGENT_STORE=True");
    if (busy >= 0) env_s[r].push_back(std::string(kBusyCoresEnv) + "=" + std::to_string(busy));
    for (auto& e : env_s[r]) envp[r].push_back(e.data());
    envp[r].push_back(nullptr);
  }

  set_handler(SIGINT, on_parent_signal, /*restart=*/false);
  set_handler(SIGTERM, on_parent_signal, /*restart=*/false);
  std::cout.flush();
  std::cerr.flush();

  const pid_t parent = ::getpid();
  pid_t pgid = 0;
  std::map<pid_t, int> rank_of;
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      if (pgid) ::kill(-pgid, SIGKILL);
      throw std::runtime_error(std::string("cannot start rank ") + std::to_string(r) + ": fork: " +
                               std::strerror(errno));
    }
    if (pid == 0) {
      // Own process group, so that the parent can stop all ranks at once
      // and a terminal's Ctrl-C reaches only the parent, which forwards it.
      ::setpgid(0, pgid);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::execve(exe.c_str(), argv.data(), envp[r].data());
      ::_exit(127);
    }
    if (pgid == 0) pgid = pid;
    ::setpgid(pid, pgid);  // also here: whichever of the two runs first
    rank_of[pid] = r;
  }

  int alive = nproc;
  int result = 0;
  bool failed = false;
  bool forwarded = false;
  while (alive > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-pgid, &status, 0);
    if (pid < 0) {
      if (errno != EINTR) break;
      if (g_parent_signal != 0) {
        if (!forwarded) {
          // The ranks agree on a step to stop at, save a checkpoint and exit.
          ::kill(-pgid, SIGINT);
          forwarded = true;
        } else {
          ::kill(-pgid, SIGKILL);
        }
        g_parent_signal = 0;
      }
      continue;
    }
    --alive;
    const int code = exit_code_of(status);
    if (code == 0 || failed) continue;
    if (forwarded && code == 130) {
      result = 130;
      continue;
    }
    std::cerr << "fusetrain: rank " << spec.node_rank * nproc + rank_of[pid] << " "
              << describe_status(status);
    if (alive > 0) {
      std::cerr << "; stopping the other " << alive << " rank" << (alive == 1 ? "" : "s")
                << " of this host";
    }
    std::cerr << "\n";
    ::kill(-pgid, SIGKILL);
    failed = true;
    result = code;
  }
  set_handler(SIGINT, SIG_DFL, true);
  set_handler(SIGTERM, SIG_DFL, true);
  return result;
}

// ------------------------------------------------------------------ Distributed

Distributed::Distributed() = default;
Distributed::~Distributed() = default;

Distributed::Distributed(const dist::Environment& env, c10::DeviceType device_type,
                         std::chrono::milliseconds timeout, bool shared_memory)
    : rank_(env.rank),
      world_size_(env.world_size),
      local_rank_(env.local_rank),
      timeout_(timeout),
      device_(device_type == c10::DeviceType::CUDA ? at::Device(at::kCUDA, env.local_rank)
                                                   : at::Device(at::kCPU)) {
  if (world_size_ > 1) {
    dist::ProcessGroupOptions options;
    options.device_type = device_type;
    options.timeout = timeout;
    options.shared_memory = shared_memory;
    group_ = dist::init_process_group(env, options);
    shared_memory_ = dist::uses_shared_memory(group_);
    if (device_type == c10::DeviceType::CPU) {
      // What gloo bound, to name the ranks behind a broken connection.
      const dist::GlooTransport t = dist::gloo_transport_for(env.master_addr, env.master_port);
      own_address_ = t.interfaces.empty() ? t.address : t.describe();
    }
  }
}

void Distributed::allreduce_sum_(const at::Tensor& t) const {
  if (!group_) return;
  std::vector<at::Tensor> ts = {t};
  group_->allreduce(ts)->wait();
}

void Distributed::allreduce_max_(const at::Tensor& t) const {
  if (!group_) return;
  std::vector<at::Tensor> ts = {t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  group_->allreduce(ts, opts)->wait();
}

void Distributed::broadcast_(const std::vector<at::Tensor>& tensors) const {
  if (!group_ || tensors.empty()) return;
  dist::broadcast_from_rank0(group_, tensors);
}

void Distributed::barrier() const {
  if (group_) group_->barrier()->wait();
}

std::vector<std::string> Distributed::allgather_text(const std::string& text) const {
  if (!group_) return {text};
  // Lengths first, then every text padded to the longest.
  // On the group's device (NCCL takes GPU tensors only), read back on the host.
  at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong).to(device_);
  allreduce_max_(length);
  const int64_t longest = length.item<int64_t>();
  at::Tensor mine = at::zeros({longest + 8}, at::kByte);
  const int64_t n = static_cast<int64_t>(text.size());
  std::memcpy(mine.data_ptr(), &n, sizeof(n));
  std::memcpy(mine.data_ptr<uint8_t>() + 8, text.data(), text.size());
  mine = mine.to(device_);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_size_; ++r) out[0].push_back(at::empty_like(mine));
  std::vector<at::Tensor> in = {mine};
  group_->allgather(out, in)->wait();
  std::vector<std::string> texts;
  for (const auto& gathered : out[0]) {
    const at::Tensor t = gathered.cpu();
    int64_t len = 0;
    std::memcpy(&len, t.data_ptr(), sizeof(len));
    texts.emplace_back(reinterpret_cast<const char*>(t.data_ptr<uint8_t>() + 8),
                       static_cast<size_t>(len));
  }
  return texts;
}

std::string Distributed::broadcast_text(const std::string& text) const {
  if (!group_) return text;
  at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong).to(device_);
  broadcast_({length});
  at::Tensor bytes = at::zeros({length.item<int64_t>()}, at::kByte);
  if (rank_ == 0) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  if (bytes.numel() > 0) {
    bytes = bytes.to(device_);
    broadcast_({bytes});
    bytes = bytes.cpu();
  }
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                     static_cast<size_t>(bytes.numel()));
}

void Distributed::learn_peer_addresses() {
  if (group_) peer_addresses_ = allgather_text(own_address_);
}

std::string Distributed::explain_failure(const std::string& what) const {
  if (!group_) return what;
  // gloo names the far end of a broken connection as "[ADDRESS]:PORT".
  std::map<std::string, std::vector<int>> ranks_at;
  for (int r = 0; r < static_cast<int>(peer_addresses_.size()); ++r) {
    if (r != rank_) ranks_at[peer_addresses_[r]].push_back(r);
  }
  std::string lost;
  for (const auto& [address, ranks] : ranks_at) {
    if (what.find("[" + address + "]") == std::string::npos) continue;
    for (int r : ranks) lost += (lost.empty() ? "" : ", ") + std::to_string(r);
    lost = "rank" + std::string(ranks.size() > 1 ? "s " : " ") + lost + " at " + address;
    break;
  }
  const long timeout_s = static_cast<long>(timeout_.count() / 1000);
  std::string head = "rank " + std::to_string(rank_) + " lost the group: ";
  if (!lost.empty()) {
    head += "the connection to " + lost + " broke (that rank died or its host went away)";
  } else if (what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos) {
    head += "no answer from a peer within runtime.timeout_s=" + std::to_string(timeout_s) +
            " s (a rank stopped, or the network between hosts is down)";
  } else {
    head += "a collective failed";
  }
  return head + "; the other ranks stop too. " + what;
}

// ------------------------------------------------------------------ ParallelModel

dist::Reducer* ParallelModel::reducer() const { return ddp_ ? &ddp_->reducer() : nullptr; }

ParallelModel::ParallelModel(Model model, const Distributed& world, dist::DDPOptions options,
                             const std::string& comm_hook, int64_t powersgd_rank,
                             int64_t powersgd_start_iter)
    : model_(std::move(model)) {
  if (!world.is_distributed()) return;
  ddp_ = std::make_unique<dist::DistributedDataParallel<Model>>(model_, world.group(), options);
  if (auto hook = dist::comm_hook_from_name(comm_hook, world.group(), powersgd_rank,
                                            powersgd_start_iter)) {
    ddp_->register_comm_hook(std::move(hook));
  }
}

ParallelModel::~ParallelModel() = default;

at::Tensor ParallelModel::forward(const at::Tensor& x) {
  return ddp_ ? ddp_->forward(x) : model_->forward(x);
}

at::Tensor ParallelModel::forward(const at::Tensor& x, const at::Tensor& targets,
                                  double label_smoothing) {
  return ddp_ ? ddp_->forward(x, targets, label_smoothing)
              : model_->forward(x, targets, label_smoothing);
}

std::shared_ptr<void> ParallelModel::no_sync() {
  if (!ddp_) return nullptr;
  return std::shared_ptr<void>(ddp_->no_sync());
}

namespace {

// The current stream is `side` for the scope's lifetime, ordered by events
// after the caller's stream's earlier work and before its later work.
class StreamScope {
 public:
  explicit StreamScope(c10::Stream side)
      : caller_(c10::impl::VirtualGuardImpl(side.device_type()).getStream(side.device())),
        guard_(side) {
    c10::Event before(side.device_type());
    before.record(caller_);
    before.block(side);
  }
  ~StreamScope() {
    c10::Event after(caller_.device_type());
    after.record(guard_.current_stream());
    after.block(caller_);
  }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  c10::Stream caller_;
  c10::StreamGuard guard_;
};

}  // namespace

std::shared_ptr<void> ParallelModel::on_ddp_stream() {
  if (!ddp_) return nullptr;
  const std::optional<c10::Stream> side = ddp_->stream();
  if (!side) return nullptr;
  return std::make_shared<StreamScope>(*side);
}

}  // namespace fusetrain::trainer
