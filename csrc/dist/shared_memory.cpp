// The shared-memory allreduce (Note [Shared-memory allreduce] in
// shared_memory.h): segment setup through the group's store, the chunked
// reduce-in-slots protocol, and a c10d backend that forwards the rest to gloo.
#include <fusetrain/dist/shared_memory.h>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FUSETRAIN_CPU_RELAX() _mm_pause()
#else
#define FUSETRAIN_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace fusetrain::dist {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxWorld = 256;
constexpr uint64_t kMagic = 0x66746d656d73686dULL;  // "ftmemshm"
constexpr size_t kPage = 4096;
// Two slot sets of W slots in all at most this much, each slot within
// [kMinSlot, kMaxSlot]: 8 MiB for two ranks, an L2-sized chunk a rank.
constexpr size_t kSegmentBudget = 8u << 20;
constexpr size_t kMinSlot = 64u << 10;
constexpr size_t kMaxSlot = 2u << 20;
// A sub-range of a chunk starts on a 64-byte line: ranks never write into
// one cache line.
constexpr size_t kLine = 64;
// Spin this long before sleeping on the futex; check on peers this often.
constexpr auto kSpin = std::chrono::microseconds(20);
constexpr auto kPeerCheck = std::chrono::milliseconds(100);

// What a rank says it is running, at the first chunk of a collective, so
// that a mismatched call fails on every rank instead of pairing barriers
// of different collectives (gloo refuses mismatched sizes too).
struct Call {
  uint32_t kind = 0;  // c10d::OpType
  int32_t root = -1;  // broadcast
  int32_t dtype = -1;
  int32_t op = -1;     // reductions
  uint64_t bytes = 0;  // this rank's input
  bool operator==(const Call& o) const {
    return kind == o.kind && root == o.root && dtype == o.dtype && op == o.op && bytes == o.bytes;
  }
};

struct alignas(kLine) Header {
  uint64_t magic;
  uint32_t world;
  uint32_t reserved;
  uint64_t slot_bytes;
  alignas(kLine) std::atomic<uint32_t> arrived;   // barrier arrivals, all barriers so far
  alignas(kLine) std::atomic<uint32_t> sleepers;  // ranks asleep on `arrived`
  alignas(kLine) int32_t pids[kMaxWorld];
  alignas(kLine) Call calls[2][kMaxWorld];  // by slot set, as the slots
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain 32-bit words");

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t header_bytes() { return round_up(sizeof(Header), kPage); }

size_t default_slot_bytes(int world) {
  const size_t fit = kSegmentBudget / (2 * static_cast<size_t>(world)) / kPage * kPage;
  return std::clamp(fit, kMinSlot, kMaxSlot);
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is in memory other processes map.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string namespace_of(const char* kind) {
  char target[256] = {};
  const std::string link = std::string("/proc/self/ns/") + kind;
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
}

// Whether process `pid` has ended: gone, or a zombie its parent has not
// reaped yet (signal 0 still reaches a zombie).
bool process_ended(int pid) {
  if (pid <= 0) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  if (!in) return true;
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the command name may hold spaces and ')'
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  const char state = stat[close + 2];
  return state == 'Z' || state == 'X';
}

// ----------------------------------------------------------- the reductions

template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<c10::BFloat16> {
  using type = float;
};
template <>
struct Acc<c10::Half> {
  using type = float;
};

template <typename A>
A combine(c10d::ReduceOp::RedOpType op, A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    switch (op) {
      case c10d::ReduceOp::SUM:
        return a + b;
      case c10d::ReduceOp::PRODUCT:
        return a * b;
      // A NaN anywhere makes the result NaN, whichever rank holds it.
      case c10d::ReduceOp::MIN:
        return (a < b || std::isnan(a)) ? a : b;
      default:
        return (a > b || std::isnan(a)) ? a : b;
    }
  } else {
    using U = std::make_unsigned_t<A>;  // sums and products wrap, as in gloo, without UB
    switch (op) {
      case c10d::ReduceOp::SUM:
        return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
      case c10d::ReduceOp::PRODUCT:
        return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
      case c10d::ReduceOp::MIN:
        return std::min(a, b);
      default:
        return std::max(a, b);
    }
  }
}

// out[i] = slots[0][i] op slots[1][i] op ... in rank order, for i in [0, n),
// accumulated in Acc<T> (float32 for 16-bit types: rounded once). `out` is
// one of the slots, so each block is reduced in a local buffer first.
template <typename T, c10d::ReduceOp::RedOpType kOp>
void reduce_into(T* out, const std::vector<const T*>& slots, size_t n) {
  using A = typename Acc<T>::type;
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t m = std::min(kBlock, n - start);
    const T* a = slots[0] + start;
    for (size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(a[i]);
    for (size_t r = 1; r < slots.size(); ++r) {
      const T* b = slots[r] + start;
      for (size_t i = 0; i < m; ++i) acc[i] = combine<A>(kOp, acc[i], static_cast<A>(b[i]));
    }
    for (size_t i = 0; i < m; ++i) out[start + i] = static_cast<T>(acc[i]);
  }
}

template <typename T>
void reduce_typed(c10d::ReduceOp::RedOpType op, void* out, const std::vector<const void*>& raw,
                  size_t n) {
  std::vector<const T*> slots;
  slots.reserve(raw.size());
  for (const void* p : raw) slots.push_back(static_cast<const T*>(p));
  T* o = static_cast<T*>(out);
  switch (op) {
    case c10d::ReduceOp::SUM:
      return reduce_into<T, c10d::ReduceOp::SUM>(o, slots, n);
    case c10d::ReduceOp::PRODUCT:
      return reduce_into<T, c10d::ReduceOp::PRODUCT>(o, slots, n);
    case c10d::ReduceOp::MIN:
      return reduce_into<T, c10d::ReduceOp::MIN>(o, slots, n);
    default:
      return reduce_into<T, c10d::ReduceOp::MAX>(o, slots, n);
  }
}

void reduce_dispatch(at::ScalarType dtype, c10d::ReduceOp::RedOpType op, void* out,
                     const std::vector<const void*>& sources, size_t n) {
  switch (dtype) {
    case at::kFloat:
      return reduce_typed<float>(op, out, sources, n);
    case at::kDouble:
      return reduce_typed<double>(op, out, sources, n);
    case at::kBFloat16:
      return reduce_typed<c10::BFloat16>(op, out, sources, n);
    case at::kHalf:
      return reduce_typed<c10::Half>(op, out, sources, n);
    case at::kInt:
      return reduce_typed<int32_t>(op, out, sources, n);
    default:
      return reduce_typed<int64_t>(op, out, sources, n);
  }
}

// No two elements of `t` share memory: with the dimensions sorted by
// stride, each stride reaches past the extent of the smaller ones.
bool distinct_elements(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size), sizes > 1 only
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements spanned by the smaller-stride dimensions
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return false;
    extent = stride * (size - 1) + extent;
  }
  return true;
}

// A tensor the segment can take: a defined strided CPU tensor. Strided
// views go through a dense copy.
bool on_cpu(const at::Tensor& t) {
  return t.defined() && t.device().type() == c10::DeviceType::CPU && t.layout() == at::kStrided;
}

// Whether the segment reduces `op` over `dtype`. Every rank decides alike:
// what it looks at is the same on every rank of a correct program.
bool reducible(at::ScalarType dtype, const c10d::ReduceOp& reduce_op) {
  switch (reduce_op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      break;
    case c10d::ReduceOp::AVG:  // the sum, divided in place (as gloo); gloo refuses integers
      if (!at::isFloatingType(dtype)) return false;
      break;
    default:
      return false;
  }
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

bool supported(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  if (tensors.size() != 1 || opts.sparseIndices.has_value()) return false;
  const at::Tensor& t = tensors.front();
  // A tensor whose elements share memory (expanded) cannot take the result.
  return on_cpu(t) && distinct_elements(t) && reducible(t.scalar_type(), opts.reduceOp);
}

// Whether the byte ranges of two dense tensors meet.
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// torch.distributed's name for a collective the segment runs.
const char* collective_name(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::ALLREDUCE:
      return "all_reduce";
    case c10d::OpType::_ALLGATHER_BASE:
      return "all_gather_into_tensor";
    case c10d::OpType::ALLGATHER:
      return "all_gather";
    case c10d::OpType::_REDUCE_SCATTER_BASE:
      return "reduce_scatter_tensor";
    case c10d::OpType::BROADCAST:
      return "broadcast";
    default:
      return "other";
  }
}

// ------------------------------------------------------------- the segment

class Segment {
 public:
  Segment(void* base, size_t bytes, int rank, int world, std::chrono::milliseconds timeout)
      : base_(static_cast<char*>(base)),
        bytes_(bytes),
        rank_(rank),
        world_(world),
        timeout_(timeout) {}
  ~Segment() { ::munmap(base_, bytes_); }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  size_t slot_bytes() const { return header()->slot_bytes; }
  char* slot(int set, int rank) const {
    return base_ + header_bytes() + (static_cast<size_t>(set) * world_ + rank) * slot_bytes();
  }

  // An in-place allreduce of `t` (dense, supported dtype and op).
  void allreduce(const at::Tensor& t, c10d::ReduceOp::RedOpType op) {
    const Busy busy(this);
    const Call call = make_call(c10d::OpType::ALLREDUCE, t.nbytes(), t.scalar_type(), op);
    const size_t elem = t.element_size();
    const size_t total = static_cast<size_t>(t.numel());
    const size_t per_chunk = slot_bytes() / elem;
    // A sub-range is a whole number of cache lines.
    const size_t line_elems = kLine / elem;
    char* data = static_cast<char*>(t.data_ptr());
    std::vector<const void*> sources(world_);
    for (size_t done = 0; done < total; done += per_chunk) {
      const size_t n = std::min(per_chunk, total - done);
      const size_t share = round_up((n + world_ - 1) / world_, line_elems);
      const int set = next_set();
      if (done == 0) announce(set, call);
      char* src = data + done * elem;
      std::memcpy(slot(set, rank_), src, n * elem);
      barrier();
      if (done == 0) check(set, call);
      const size_t lo = std::min(n, share * rank_), hi = std::min(n, lo + share);
      if (hi > lo) {
        for (int r = 0; r < world_; ++r) sources[r] = slot(set, r) + lo * elem;
        reduce_dispatch(t.scalar_type(), op, slot(set, rank_) + lo * elem, sources, hi - lo);
      }
      barrier();
      for (int r = 0; r < world_; ++r) {
        const size_t a = std::min(n, share * r), b = std::min(n, a + share);
        if (b > a) std::memcpy(src + a * elem, slot(set, r) + a * elem, (b - a) * elem);
      }
    }
  }

  // out = every rank's `in` (`bytes` each) end to end in rank order. `in`
  // may be this rank's place in `out` (in place), else apart from it. One
  // barrier a chunk: each rank copies its chunk in, then the others' out.
  void allgather(const char* in, char* out, size_t bytes, at::ScalarType dtype) {
    if (bytes == 0) return;
    const Busy busy(this);
    const Call call = make_call(c10d::OpType::ALLGATHER, bytes, dtype);
    char* own = out + static_cast<size_t>(rank_) * bytes;
    if (in != own) std::memcpy(own, in, bytes);
    for (size_t done = 0; done < bytes; done += slot_bytes()) {
      const size_t n = std::min(slot_bytes(), bytes - done);
      const int set = next_set();
      if (done == 0) announce(set, call);
      std::memcpy(slot(set, rank_), in + done, n);
      barrier();
      if (done == 0) check(set, call);
      for (int r = 0; r < world_; ++r) {
        if (r != rank_) std::memcpy(out + r * bytes + done, slot(set, r), n);
      }
    }
  }

  // t = root's t (dense, `bytes`): the root copies a chunk in, the others
  // copy it out after one barrier.
  void broadcast(char* t, size_t bytes, int root, at::ScalarType dtype) {
    if (bytes == 0) return;
    const Busy busy(this);
    Call call = make_call(c10d::OpType::BROADCAST, bytes, dtype);
    call.root = root;
    for (size_t done = 0; done < bytes; done += slot_bytes()) {
      const size_t n = std::min(slot_bytes(), bytes - done);
      const int set = next_set();
      if (done == 0) announce(set, call);
      if (rank_ == root) std::memcpy(slot(set, root), t + done, n);
      barrier();
      if (done == 0) check(set, call);
      if (rank_ != root) std::memcpy(t + done, slot(set, root), n);
    }
  }

  // out = piece `rank` of every rank's `in` (world pieces of out.numel()
  // elements, dense) reduced in rank order, as allreduce reduces it: the
  // same bits. `out` is in's own piece (in place) or apart from `in`. A
  // chunk of a slot holds world sub-chunks, sub-chunk q for rank q; each
  // rank copies in the others' sub-chunks and, after one barrier, reduces
  // its own from every slot (its own input read in place).
  void reduce_scatter(const at::Tensor& in, const at::Tensor& out, c10d::ReduceOp::RedOpType op) {
    const Busy busy(this);
    const Call call =
        make_call(c10d::OpType::_REDUCE_SCATTER_BASE, in.nbytes(), in.scalar_type(), op);
    const size_t elem = in.element_size();
    const size_t n = static_cast<size_t>(out.numel());
    const size_t line_elems = kLine / elem;
    const size_t per_chunk = slot_bytes() / world_ / elem / line_elems * line_elems;
    const char* data = static_cast<const char*>(in.const_data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    std::vector<const void*> sources(world_);
    for (size_t done = 0; done < n; done += per_chunk) {
      const size_t m = std::min(per_chunk, n - done);
      const int set = next_set();
      if (done == 0) announce(set, call);
      for (int q = 0; q < world_; ++q) {
        if (q != rank_) {
          std::memcpy(slot(set, rank_) + q * per_chunk * elem, data + (q * n + done) * elem,
                      m * elem);
        }
      }
      barrier();
      if (done == 0) check(set, call);
      for (int r = 0; r < world_; ++r) {
        sources[r] =
            r == rank_ ? data + (rank_ * n + done) * elem : slot(set, r) + rank_ * per_chunk * elem;
      }
      reduce_dispatch(in.scalar_type(), op, dst + done * elem, sources, m);
    }
  }

  /// Whether a collective stopped inside the segment (a barrier timed out,
  /// a peer was lost, the calls did not match): then the ranks are out of
  /// step, and no later collective can pair its barriers with theirs.
  bool out_of_step() const { return busy_; }

 private:
  // Marks a collective running in the segment; an exception out of it
  // leaves busy_ set (out_of_step()).
  struct Busy {
    explicit Busy(Segment* s) : segment(s) { segment->busy_ = true; }
    ~Busy() {
      if (std::uncaught_exceptions() == 0) segment->busy_ = false;
    }
    Segment* segment;
  };

  Call make_call(c10d::OpType kind, size_t bytes, at::ScalarType dtype, int op = -1) const {
    Call call;
    call.kind = static_cast<uint32_t>(kind);
    call.dtype = static_cast<int32_t>(dtype);
    call.op = op;
    call.bytes = bytes;
    return call;
  }

  // Publishes this rank's call in slot set `set` (before the chunk's
  // barrier; the set is not rewritten until every rank has read it, as the
  // slots), and compares every rank's after it: a mismatch fails every rank.
  void announce(int set, const Call& call) { header()->calls[set][rank_] = call; }
  void check(int set, const Call& call) const {
    for (int r = 0; r < world_; ++r) {
      const Call& theirs = header()->calls[set][r];
      TORCH_CHECK(theirs == call, "rank ", rank_,
                  ": the shared-memory collectives of the ranks do ", "not match: this rank runs ",
                  describe(call), ", rank ", r, " runs ", describe(theirs),
                  ". Every rank must issue the same collectives in the same order, with the same "
                  "sizes, dtypes, reductions and roots");
    }
  }
  static const char* reduction_name(int op) {
    switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
      case c10d::ReduceOp::SUM:
        return "sum";
      case c10d::ReduceOp::PRODUCT:
        return "product";
      case c10d::ReduceOp::MIN:
        return "min";
      case c10d::ReduceOp::MAX:
        return "max";
      default:
        return "other";
    }
  }
  static std::string describe(const Call& call) {
    std::ostringstream out;
    out << collective_name(static_cast<c10d::OpType>(call.kind)) << " of " << call.bytes
        << " bytes";
    if (call.dtype >= 0) out << " of " << c10::toString(static_cast<at::ScalarType>(call.dtype));
    if (call.op >= 0) out << ", reduction " << reduction_name(call.op);
    if (call.root >= 0) out << ", root " << call.root;
    return out.str();
  }

  // The slot set of the next chunk. The sets alternate, so a rank writes
  // set s again only after the barrier of the chunk between, which every
  // rank reaches after it has read all it needs of set s: one barrier a
  // chunk keeps the ranks apart whatever the collectives in between.
  int next_set() { return static_cast<int>(chunks_++ & 1); }

  // Waits until every rank has arrived at this barrier (the ranks pass
  // them in the same order, counting on one shared word).
  void barrier() {
    Header* h = header();
    ++barriers_;
    const uint32_t target = static_cast<uint32_t>(barriers_ * static_cast<uint64_t>(world_));
    const auto reached = [&](uint32_t seen) { return static_cast<int32_t>(seen - target) >= 0; };
    if (reached(h->arrived.fetch_add(1, std::memory_order_seq_cst) + 1)) {
      if (h->sleepers.load(std::memory_order_seq_cst) > 0) {
        futex(&h->arrived, FUTEX_WAKE, INT_MAX, nullptr);
      }
      return;
    }
    const auto start = Clock::now();
    uint32_t seen = 0;
    for (int i = 0;; ++i) {
      seen = h->arrived.load(std::memory_order_acquire);
      if (reached(seen)) return;
      FUSETRAIN_CPU_RELAX();
      if ((i & 63) == 63 && Clock::now() - start > kSpin) break;
    }
    auto last_check = Clock::now();
    for (;;) {
      h->sleepers.fetch_add(1, std::memory_order_seq_cst);
      seen = h->arrived.load(std::memory_order_seq_cst);
      if (!reached(seen)) {
        const timespec nap{0, 10'000'000};  // 10 ms, to look at the clock and the peers
        futex(&h->arrived, FUTEX_WAIT, seen, &nap);
      }
      h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (reached(h->arrived.load(std::memory_order_acquire))) return;
      const auto now = Clock::now();
      if (now - last_check >= kPeerCheck) {
        last_check = now;
        for (int r = 0; r < world_; ++r) {
          TORCH_CHECK(r == rank_ || !process_ended(h->pids[r]), "rank ", rank_,
                      ": the shared-memory allreduce lost rank ", r, " (pid ", h->pids[r],
                      "), which has exited");
        }
      }
      TORCH_CHECK(now - start < timeout_, "rank ", rank_, ": the shared-memory allreduce waited ",
                  timeout_.count(), " ms for ", target - h->arrived.load(), " of ", world_,
                  " ranks to arrive (the group's timeout; a rank is stuck or out of step)");
    }
  }

  char* base_;
  size_t bytes_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
  uint64_t barriers_ = 0, chunks_ = 0;
  bool busy_ = false;
};

// ---------------------------------------------------------------- the work

// A collective that ran on the calling thread: complete, or failed with
// `error`, which wait() throws.
class DoneWork : public c10d::Work {
 public:
  DoneWork(c10d::OpType type, std::vector<at::Tensor> tensors, std::exception_ptr error)
      : c10d::Work(-1, type), tensors_(std::move(tensors)), error_(error) {
    future_ =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (error_) {
      future_->setError(error_);
    } else {
      future_->markCompleted(c10::IValue(tensors_));
    }
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return !error_; }
  std::exception_ptr exception() const override { return error_; }
  std::vector<at::Tensor> result() override { return tensors_; }
  void synchronize() override {}
  bool wait(std::chrono::milliseconds) override {
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> tensors_;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// ------------------------------------------------------------- the backend

// ReduceOp.AVG of an integer tensor, which gloo refuses with "result type
// Float can't be cast to the desired output type Long" once the sum is in:
// refused before any rank sends anything, saying what to do instead.
void check_average(const char* collective, const std::vector<at::Tensor>& tensors,
                   const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::AVG) return;
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(!t.defined() || at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()),
                      collective, " with ReduceOp.AVG of a ", t.scalar_type(), " tensor: the fusetrain "
                      "backend, like gloo, averages floating-point tensors only; reduce with "
                      "ReduceOp.SUM and divide by the group's size (Lightning's fusetrain_ddp "
                      "strategies do so for self.log(..., sync_dist=True))");
  }
}

class SharedMemoryBackend final : public c10d::Backend {
 public:
  SharedMemoryBackend(int rank, int size, std::unique_ptr<Segment> segment,
                      c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(rank, size), segment_(std::move(segment)), gloo_(std::move(gloo)) {}

  // "gloo": every collective the segment does not take is gloo's, and code
  // that asks the group's backend name means which transport it speaks.
  const std::string getBackendName() const override { return gloo_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return gloo_->getBackendOptions(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    check_average("all_reduce", tensors, opts.reduceOp);
    if (!supported(tensors, opts)) return gloo_->allreduce(tensors, opts);
    return run(c10d::OpType::ALLREDUCE, tensors, [&] {
      at::Tensor& t = tensors.front();
      const bool average = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
      const auto op = average ? c10d::ReduceOp::SUM : opts.reduceOp.op_;
      if (t.numel() > 0 && t.is_non_overlapping_and_dense()) {
        segment_->allreduce(t, op);
      } else if (t.numel() > 0) {
        const at::Tensor dense = t.contiguous();
        segment_->allreduce(dense, op);
        t.copy_(dense);
      }
      if (average) t.div_(getSize());
    });
  }

  // all_gather_into_tensor: `out` holds the ranks' `in` end to end. Any
  // dtype (the bytes are copied); `in` may be out's own piece.
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    if (!on_cpu(out) || !on_cpu(in) || out.scalar_type() != in.scalar_type() ||
        out.numel() != in.numel() * getSize()) {
      return gloo_->_allgather_base(out, in, o);  // gloo's own error for wrong sizes
    }
    std::vector<at::Tensor> tensors{out};
    return run(c10d::OpType::_ALLGATHER_BASE, tensors, [&] {
      if (in.numel() == 0) return;
      const at::Tensor dst =
          out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
      const at::Tensor own = dst.view(-1).narrow(0, getRank() * in.numel(), in.numel());
      // In place when `in` is out's own piece; a copy when it lies elsewhere
      // in out (or is strided), so no rank overwrites what it still sends.
      const bool in_place = in.is_contiguous() && in.const_data_ptr() == own.const_data_ptr();
      const at::Tensor src = in_place || (in.is_contiguous() && !overlap(in, dst))
                                 ? in
                                 : in.clone(at::MemoryFormat::Contiguous);
      segment_->allgather(static_cast<const char*>(src.const_data_ptr()),
                          static_cast<char*>(dst.data_ptr()), src.nbytes(), src.scalar_type());
      if (!dst.is_same(out)) out.copy_(dst);
    });
  }

  // all_gather: one output tensor a rank, through one dense buffer.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    bool ours = in.size() == 1 && out.size() == 1 && on_cpu(in[0]) &&
                out[0].size() == static_cast<size_t>(getSize());
    for (size_t r = 0; ours && r < out[0].size(); ++r) {
      const at::Tensor& t = out[0][r];
      ours = on_cpu(t) && t.scalar_type() == in[0].scalar_type() && t.sizes() == in[0].sizes();
    }
    if (!ours) return gloo_->allgather(out, in, o);
    return run(c10d::OpType::ALLGATHER, out[0], [&] {
      const int64_t n = in[0].numel();
      at::Tensor all = at::empty({n * getSize()}, in[0].options());
      const at::Tensor src = in[0].contiguous();
      segment_->allgather(static_cast<const char*>(src.const_data_ptr()),
                          static_cast<char*>(all.data_ptr()), src.nbytes(), src.scalar_type());
      for (int r = 0; r < getSize(); ++r) {
        out[0][r].copy_(all.narrow(0, r * n, n).view(in[0].sizes()));
      }
    });
  }

  // reduce_scatter_tensor: `out` = piece `rank` of `in`, reduced over the
  // ranks in rank order (the allreduce's bits). `out` may be in's own piece.
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    check_average("reduce_scatter_tensor", {in}, o.reduceOp);
    if (!on_cpu(out) || !on_cpu(in) || out.scalar_type() != in.scalar_type() ||
        in.numel() != out.numel() * getSize() || !reducible(in.scalar_type(), o.reduceOp)) {
      return gloo_->_reduce_scatter_base(out, in, o);
    }
    std::vector<at::Tensor> tensors{out};
    return run(c10d::OpType::_REDUCE_SCATTER_BASE, tensors, [&] {
      const bool average = o.reduceOp.op_ == c10d::ReduceOp::AVG;
      const auto op = average ? c10d::ReduceOp::SUM : o.reduceOp.op_;
      if (out.numel() > 0) {
        const at::Tensor src = in.is_contiguous() ? in : in.contiguous();
        const int64_t n = out.numel();
        const at::Tensor own = src.view(-1).narrow(0, getRank() * n, n);
        const bool in_place = out.is_contiguous() && out.const_data_ptr() == own.const_data_ptr();
        const at::Tensor dst = in_place || (out.is_contiguous() && !overlap(out, src))
                                   ? out
                                   : at::empty({n}, out.options());
        segment_->reduce_scatter(src, dst, op);
        if (!dst.is_same(out)) out.copy_(dst.view(out.sizes()));
      }
      if (average) out.div_(getSize());
    });
  }

  // broadcast: the root's tensor through its slot, a chunk at a time. The
  // path is chosen on what every rank shares (not on this rank's strides: an
  // expanded tensor is a fine root); a receiver whose elements share memory
  // gets the data in a dense buffer and then the error copy_ gives, with the
  // ranks still in step.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& o) override {
    if (tensors.size() != 1 || o.rootTensor != 0 || o.rootRank < 0 || o.rootRank >= getSize() ||
        !on_cpu(tensors[0])) {
      return gloo_->broadcast(tensors, o);
    }
    return run(c10d::OpType::BROADCAST, tensors, [&] {
      at::Tensor& t = tensors.front();
      if (t.numel() == 0) return;
      const bool root = getRank() == o.rootRank;
      const at::Tensor dense = t.is_contiguous() ? t : t.contiguous();
      segment_->broadcast(static_cast<char*>(dense.data_ptr()), dense.nbytes(),
                          static_cast<int>(o.rootRank), dense.scalar_type());
      if (!root && !dense.is_same(t)) t.copy_(dense);
    });
  }

  // Everything else is gloo's.
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& t,
                                                  const c10d::AllreduceOptions& o) override {
    return gloo_->allreduce_sparse(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) override {
    return gloo_->allreduce_coalesced(t, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t,
                                        const c10d::ReduceOptions& o) override {
    return gloo_->reduce(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) override {
    return gloo_->allgather_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
      const c10d::AllgatherOptions& o) override {
    return gloo_->allgather_into_tensor_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out,
                                        std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override {
    return gloo_->gather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out,
                                         std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override {
    return gloo_->scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    return gloo_->reduce_scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
      const c10d::ReduceScatterOptions& o) override {
    return gloo_->reduce_scatter_tensor_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    return gloo_->alltoall_base(out, in, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllToAllOptions& o) override {
    return gloo_->alltoall(out, in, o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    gloo_->monitoredBarrier(o, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { gloo_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return gloo_->getSequenceNumberForGroup(); }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return gloo_->send(t, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return gloo_->recv(t, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return gloo_->recvAnysource(t, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    return gloo_->barrier(o);
  }
  void enableCollectivesTiming() override { gloo_->enableCollectivesTiming(); }
  void abort() override { gloo_->abort(); }
  void shutdown() override { gloo_->shutdown(); }

  /// The collectives this backend has run through the segment, by kind.
  std::map<std::string, int64_t> counts() {
    std::lock_guard<std::mutex> lock(counts_mutex_);
    return counts_;
  }

 private:
  // Runs one collective through the segment on the calling thread, one at
  // a time. A failure leaves the ranks out of step: every later collective
  // through the segment fails alike.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType type, const std::vector<at::Tensor>& tensors,
                                     F&& collective) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) return c10::make_intrusive<DoneWork>(type, tensors, failure_);
    {
      std::lock_guard<std::mutex> count_lock(counts_mutex_);
      ++counts_[collective_name(type)];
    }
    try {
      collective();
    } catch (const std::exception&) {
      // An error inside the segment leaves the ranks out of step: every
      // later collective fails alike. One before or after it (allocating a
      // buffer, copying into an output) is this call's alone.
      if (segment_->out_of_step()) failure_ = std::current_exception();
      return c10::make_intrusive<DoneWork>(type, tensors, std::current_exception());
    }
    return c10::make_intrusive<DoneWork>(type, tensors, nullptr);
  }

  std::unique_ptr<Segment> segment_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::mutex mutex_;  // one collective at a time
  std::exception_ptr failure_;
  std::mutex counts_mutex_;  // not mutex_: reading the counts never waits on a collective
  std::map<std::string, int64_t> counts_;
};

// Creates (rank 0) or maps (the others) the segment named `name`; nullptr
// with `why` set when this rank cannot.
std::unique_ptr<Segment> map_segment(const std::string& name, bool create, int rank, int world,
                                     size_t slot_bytes, std::chrono::milliseconds timeout,
                                     std::string* why) {
  const size_t bytes = header_bytes() + 2 * static_cast<size_t>(world) * slot_bytes;
  const int fd = ::shm_open(name.c_str(), create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
  if (fd < 0) {
    *why = "shm_open(" + name + "): " + std::strerror(errno);
    return nullptr;
  }
  if (create) {
    // posix_fallocate, not ftruncate alone: a full /dev/shm must fail here,
    // not with SIGBUS at the first touch.
    const int rc = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0
                       ? ::posix_fallocate(fd, 0, static_cast<off_t>(bytes))
                       : errno;
    if (rc != 0) {
      *why =
          "cannot size " + name + " to " + std::to_string(bytes) + " bytes: " + std::strerror(rc);
      ::close(fd);
      return nullptr;
    }
  } else {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
      *why = name + " is not the segment rank 0 made (size " + std::to_string(st.st_size) + ")";
      ::close(fd);
      return nullptr;
    }
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    *why = "mmap of " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  auto segment = std::make_unique<Segment>(base, bytes, rank, world, timeout);
  Header* h = segment->header();
  if (create) {
    // Fresh pages are zero: the counters start at 0.
    h->world = static_cast<uint32_t>(world);
    h->slot_bytes = slot_bytes;
    h->magic = kMagic;
  } else if (h->magic != kMagic || h->world != static_cast<uint32_t>(world) ||
             h->slot_bytes != slot_bytes) {
    *why = name + " does not hold this group's header";
    return nullptr;
  }
  h->pids[rank] = static_cast<int32_t>(::getpid());
  return segment;
}

std::string unique_segment_name() {
  std::random_device device;
  std::ostringstream name;
  name << "/fusetrain-" << ::getpid() << "-" << std::hex << device() << device();
  return name.str();
}

}  // namespace

std::string shared_memory_host_identity() {
  std::string id = read_line("/proc/sys/kernel/random/boot_id");
  for (const char* kind : {"net", "pid", "mnt", "ipc"}) id += "|" + namespace_of(kind);
  return id;
}

c10::intrusive_ptr<c10d::Backend> make_shared_memory_backend(
    const c10::intrusive_ptr<c10d::Store>& base_store, int rank, int world_size,
    std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> fallback,
    size_t slot_bytes) {
  if (world_size < 2 || world_size > kMaxWorld) return {};
  auto store = c10::make_intrusive<c10d::PrefixStore>("fusetrain_shm", base_store);
  const auto text = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  const auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };

  // One host? Every rank reads every identity, so all decide alike.
  const std::string mine = shared_memory_host_identity();
  store->set("host/" + std::to_string(rank), bytes(mine));
  for (int r = 0; r < world_size; ++r) {
    if (text(store->get("host/" + std::to_string(r))) != mine) return {};
  }

  if (slot_bytes == 0) slot_bytes = default_slot_bytes(world_size);
  TORCH_CHECK_VALUE(
      slot_bytes % kPage == 0 && slot_bytes >= kLine * static_cast<size_t>(world_size),
      "make_shared_memory_backend: slot_bytes=", slot_bytes, " must be a multiple of ", kPage,
      " of at least 64 bytes a rank");
  std::string why;
  std::unique_ptr<Segment> segment;
  std::string name;
  if (rank == 0) {
    name = unique_segment_name();
    segment = map_segment(name, true, rank, world_size, slot_bytes, timeout, &why);
    store->set("name", bytes(segment ? name : std::string()));
  } else {
    name = text(store->get("name"));
    if (name.empty()) {
      why = "rank 0 could not create it";
    } else {
      segment = map_segment(name, false, rank, world_size, slot_bytes, timeout, &why);
    }
  }
  store->set("ok/" + std::to_string(rank), bytes(segment ? "" : why.empty() ? "?" : why));
  std::string failed;
  for (int r = 0; r < world_size; ++r) {
    const std::string status = text(store->get("ok/" + std::to_string(r)));
    if (!status.empty() && failed.empty()) failed = "rank " + std::to_string(r) + ": " + status;
  }
  // Every rank has mapped it (or given up): the name can go, and the memory
  // goes with the last process that unmaps it, however the run ends.
  if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
  if (!failed.empty()) {
    if (rank == 0) {
      TORCH_WARN(
          "fusetrain: the ranks' allreduces go through gloo: the shared-memory segment "
          "failed on ",
          failed);
    }
    return {};
  }
  return c10::make_intrusive<SharedMemoryBackend>(rank, world_size, std::move(segment),
                                                  std::move(fallback));
}

namespace {

// `group`'s CPU backend when it is the shared-memory one, else nullptr.
c10::intrusive_ptr<SharedMemoryBackend> shared_memory_backend_of(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group || !group->hasBackends()) return {};
  try {
    auto backend = group->getBackend(c10::DeviceType::CPU);
    if (dynamic_cast<SharedMemoryBackend*>(backend.get()) == nullptr) return {};
    return c10::static_intrusive_pointer_cast<SharedMemoryBackend>(backend);
  } catch (const std::exception&) {
    return {};
  }
}

}  // namespace

bool uses_shared_memory(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return shared_memory_backend_of(group).defined();
}

std::map<std::string, int64_t> shared_memory_collectives(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  const auto backend = shared_memory_backend_of(group);
  return backend ? backend->counts() : std::map<std::string, int64_t>{};
}

}  // namespace fusetrain::dist
