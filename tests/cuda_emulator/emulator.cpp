// The CUDA emulator's runtime: fibers, the block scheduler, barriers,
// shuffles and the error state (Note [CUDA emulator] in emulator.h).
#include "emulator.h"

#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#else
#define CUDA_EMU_ASAN 0
#endif

namespace cuda_emu {

namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kMaxBlockThreads = 1024;
// CUDA 12.1+ on Volta and newer: 32764 bytes of kernel parameters.
constexpr size_t kMaxParamBytes = 32764;
// A thread's frame holds its by-value parameters (up to 32 KB of them) and,
// under AddressSanitizer, redzones around every local.
constexpr size_t kStackBytes = 512 * 1024;

// ------------------------------------------------------------ contexts
// A fiber switch on x86-64 saves the callee-saved registers on the current
// stack and swaps stack pointers: no system call (swapcontext saves the
// signal mask with one, which made it most of the emulator's time).
// Elsewhere, ucontext.

#if defined(__x86_64__)

using Context = void*;  // the saved stack pointer

extern "C" void cuda_emu_switch_stack(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type cuda_emu_switch_stack, @function
cuda_emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_switch_stack, .-cuda_emu_switch_stack
)");

// A context that starts `entry` (which must never return) on the stack
// [stack, stack + size): the six registers the switch pops, then entry as
// its return address, placed so that entry sees the stack alignment of a call.
void make_context(Context& context, char* stack, size_t size, void (*entry)()) {
  auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15});
  *--top = 0;  // entry's own return address: none
  *--top = reinterpret_cast<uintptr_t>(entry);
  for (int r = 0; r < 6; ++r) *--top = 0;
  context = top;
}

void switch_context(Context& from, Context& to) { cuda_emu_switch_stack(&from, to); }

#else

using Context = ucontext_t;

void make_context(Context& context, char* stack, size_t size, void (*entry)()) {
  getcontext(&context);
  context.uc_stack.ss_sp = stack;
  context.uc_stack.ss_size = size;
  context.uc_link = nullptr;
  makecontext(&context, entry, 0);
}

void switch_context(Context& from, Context& to) { swapcontext(&from, &to); }

#endif

enum class State { kReady, kAtBarrier, kAtShuffle, kExited };

struct Thread {
  Context context;
  char* stack = nullptr;  // kStackBytes usable, a guard page below
  uint3 idx;
  int linear = 0;
  State state = State::kExited;
  const char* file = nullptr;  // where it waits
  int line = 0;
  // The shuffle it waits in (Note [Shuffle rendezvous]): which, its mask,
  // the bits it publishes, the lane it reads and what it got.
  const char* what = nullptr;
  unsigned mask = 0;
  uint64_t value = 0;
  uint64_t result = 0;
  int source = 0;
  void* fake_stack = nullptr;  // AddressSanitizer's, while switched out
};

// Note [Shuffle rendezvous]
// A shuffle completes when every lane of its mask waits in it: the same
// intrinsic at the same line with the same mask. Each lane records the
// shuffle it waits in, so a warp may have several pending at once, as on
// Volta and later: the two halves of a warp reducing with masks 0x0000ffff
// and 0xffff0000, or lanes 0-15 in a shuffle of their own while lanes 16-31
// already wait in a full-warp one that lanes 0-15 reach next. (A single
// pending shuffle per warp would report both as mismatches.) A lane of the
// mask waiting in another shuffle is an error at once only when that
// shuffle's mask names the caller too: each then waits for the other for
// ever. Any other wait that never ends is a deadlock, which the scheduler
// reports.

struct Emulator {
  bool order_read = false;
  Order order = Order::kForward;

  cudaError_t sticky = cudaSuccess;
  cudaError_t last = cudaSuccess;
  std::string message;
  Counts counts;

  // The launch and block being run.
  const LaunchSite* site = nullptr;
  const std::function<void()>* body = nullptr;
  dim3 grid_dim;
  dim3 block_dim;
  uint3 block_idx;
  std::vector<Thread> threads;
  int live = 0;  // threads of the block not yet returned
  Thread* current = nullptr;
  bool aborted = false;
  int barrier_arrived = 0;
  const Thread* barrier_first = nullptr;

  Context scheduler;
  Context discarded;  // where a thread that never resumes saves itself
  const void* scheduler_stack = nullptr;  // its bounds, for AddressSanitizer
  size_t scheduler_stack_size = 0;
  void* scheduler_fake_stack = nullptr;
};

Emulator& emu() {
  static Emulator e;
  return e;
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

// The launching function's template arguments, e.g. "[with T = float; int
// kRowThreads = 32]": they tell which instantiation of the kernel ran.
std::string instantiation(const char* caller) {
  const char* with = std::strstr(caller, " [with ");
  return with != nullptr ? std::string(with + 1) : std::string("launched from ") + caller;
}

std::string where_launched() {
  const Emulator& e = emu();
  return format("kernel %s %s (launch at %s:%d)", e.site->kernel,
                instantiation(e.site->caller).c_str(), e.site->file, e.site->line);
}

std::string thread_name(const Thread& t) {
  const Emulator& e = emu();
  return format("block (%u,%u,%u) thread (%u,%u,%u)", e.block_idx.x, e.block_idx.y, e.block_idx.z,
                t.idx.x, t.idx.y, t.idx.z);
}

// cudaGetErrorName's text for the errors the emulator raises (the runtime
// library itself is not linked).
const char* error_name(cudaError_t error) {
  switch (error) {
    case cudaErrorAssert:
      return "cudaErrorAssert";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    default:
      return "cudaError";
  }
}

void set_error(cudaError_t error, const std::string& what, bool sticky) {
  Emulator& e = emu();
  e.last = error;
  if (sticky) e.sticky = error;
  e.message = std::string(error_name(error)) + ": " + what;
}

// ------------------------------------------------------------------ fibers
// AddressSanitizer must be told when the stack changes (and a fiber's stack
// is reused by later blocks, so it is unpoisoned before each use).

void start_switch(void** fake_stack_save, const void* bottom, size_t size) {
#if CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack_save, bottom, size);
#else
  (void)fake_stack_save, (void)bottom, (void)size;
#endif
}

void finish_switch(void* fake_stack_save, const void** bottom_old, size_t* size_old) {
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack_save, bottom_old, size_old);
#else
  (void)fake_stack_save, (void)bottom_old, (void)size_old;
#endif
}

// From a thread back to the scheduler; returns when the scheduler runs it again.
void yield() {
  Emulator& e = emu();
  Thread& me = *e.current;
  start_switch(&me.fake_stack, e.scheduler_stack, e.scheduler_stack_size);
  switch_context(me.context, e.scheduler);
  finish_switch(me.fake_stack, nullptr, nullptr);
}

// From a thread that will never run again (returned, or stopped by an error).
[[noreturn]] void leave_thread() {
  Emulator& e = emu();
  start_switch(nullptr, e.scheduler_stack, e.scheduler_stack_size);
  switch_context(e.discarded, e.scheduler);
  std::abort();  // never resumed
}

// A violation found on a thread: the launch stops with a sticky error.
[[noreturn]] void fail_on_thread(cudaError_t error, const std::string& what) {
  Emulator& e = emu();
  set_error(error, where_launched() + ", " + thread_name(*e.current) + ": " + what, true);
  e.aborted = true;
  leave_thread();
}

void release_barrier_if_complete() {
  Emulator& e = emu();
  if (e.barrier_arrived == 0 || e.barrier_arrived < e.live) return;
  for (Thread& t : e.threads) {
    if (t.state == State::kAtBarrier) t.state = State::kReady;
  }
  e.barrier_arrived = 0;
  e.barrier_first = nullptr;
}

std::string lanes_text(unsigned lanes) {
  std::string s;
  for (int l = 0; l < kWarpSize; ++l) {
    if (!((lanes >> l) & 1u)) continue;
    int r = l;
    while (r + 1 < kWarpSize && ((lanes >> (r + 1)) & 1u)) ++r;
    // Appended piece by piece: GCC 12 at C++20 warns (-Wrestrict, a false
    // positive) on the temporary `const char* + std::string`.
    if (!s.empty()) s += ',';
    s += r == l ? std::to_string(l) : format("%d-%d", l, r);
    l = r;
  }
  return s.empty() ? "none" : s;
}

// Whether t waits in this shuffle. The names are literals, the same pointer
// almost always: compared first, as this runs for every lane of every shuffle.
bool same_shuffle(const Thread& t, const char* what, const char* file, int line, unsigned mask) {
  return t.state == State::kAtShuffle && t.mask == mask && t.line == line &&
         (t.file == file || std::strcmp(t.file, file) == 0) &&
         (t.what == what || std::strcmp(t.what, what) == 0);
}

// The lanes of t's warp waiting in the shuffle t waits in.
unsigned lanes_waiting_with(const Thread& t) {
  const Emulator& e = emu();
  const int warp = t.linear / kWarpSize;
  unsigned lanes = 0;
  for (int l = 0; l < kWarpSize; ++l) {
    const int i = warp * kWarpSize + l;
    if (i < static_cast<int>(e.threads.size()) &&
        same_shuffle(e.threads[i], t.what, t.file, t.line, t.mask)) {
      lanes |= 1u << l;
    }
  }
  return lanes;
}

// A lane of me's warp that waits in a shuffle whose mask names me, or null.
const Thread* shuffle_waiting_for(const Thread& me) {
  const Emulator& e = emu();
  const int warp = me.linear / kWarpSize;
  const int lane = me.linear % kWarpSize;
  for (int l = 0; l < kWarpSize; ++l) {
    const int i = warp * kWarpSize + l;
    if (i >= static_cast<int>(e.threads.size()) || l == lane) continue;
    const Thread& t = e.threads[i];
    if (t.state == State::kAtShuffle && ((t.mask >> lane) & 1u)) return &t;
  }
  return nullptr;
}

// A returning thread must not leave a shuffle of its warp waiting for it.
void check_no_shuffle_waits_for(const Thread& me) {
  if (const Thread* t = shuffle_waiting_for(me)) {
    fail_on_thread(
        cudaErrorLaunchFailure,
        format("returned while lanes %s of its warp wait for it in %s at %s:%d (mask 0x%08x)",
               lanes_text(lanes_waiting_with(*t)).c_str(), t->what, t->file, t->line, t->mask));
  }
}

void thread_main() {
  Emulator& e = emu();
  finish_switch(nullptr, &e.scheduler_stack, &e.scheduler_stack_size);
  (*e.body)();
  Thread& me = *e.current;
  check_no_shuffle_waits_for(me);
  me.state = State::kExited;
  --e.live;
  release_barrier_if_complete();
  leave_thread();
}

char* new_stack() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("cuda_emu: mmap of a thread stack");
    std::abort();
  }
  mprotect(p, page, PROT_NONE);  // a guard page: an overflowing frame faults
  return static_cast<char*>(p) + page;
}

std::string describe_waiting_threads() {
  const Emulator& e = emu();
  std::string s;
  int listed = 0;
  int waiting = 0;
  for (const Thread& t : e.threads) {
    if (t.state != State::kAtBarrier && t.state != State::kAtShuffle) continue;
    ++waiting;
    if (listed++ < 6) {
      s += format("; thread (%u,%u,%u) waits in %s at %s:%d", t.idx.x, t.idx.y, t.idx.z,
                  t.state == State::kAtBarrier ? "__syncthreads" : t.what, t.file, t.line);
    }
  }
  if (waiting > listed) s += format("; and %d more", waiting - listed);
  return s;
}

void run_block(const dim3& block_idx) {
  Emulator& e = emu();
  e.block_idx = uint3{block_idx.x, block_idx.y, block_idx.z};
  const int n = static_cast<int>(e.block_dim.x * e.block_dim.y * e.block_dim.z);
  if (e.threads.size() < static_cast<size_t>(n)) e.threads.resize(n);
  for (int i = 0; i < n; ++i) {
    Thread& t = e.threads[i];
    if (t.stack == nullptr) t.stack = new_stack();
#if CUDA_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(t.stack, kStackBytes);
#endif
    t.linear = i;
    t.idx = uint3{static_cast<unsigned>(i) % e.block_dim.x,
                  static_cast<unsigned>(i) / e.block_dim.x % e.block_dim.y,
                  static_cast<unsigned>(i) / (e.block_dim.x * e.block_dim.y)};
    t.state = State::kReady;
    t.fake_stack = nullptr;
    make_context(t.context, t.stack, kStackBytes, thread_main);
  }
  for (size_t i = n; i < e.threads.size(); ++i) e.threads[i].state = State::kExited;
  e.live = n;
  e.barrier_arrived = 0;
  e.barrier_first = nullptr;
  ++e.counts.blocks;
  e.counts.threads += n;

  const bool reverse = order() == Order::kReverse;
  while (e.live > 0) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      Thread& t = e.threads[reverse ? n - 1 - k : k];
      if (t.state != State::kReady) continue;
      ran = true;
      e.current = &t;
      start_switch(&e.scheduler_fake_stack, t.stack, kStackBytes);
      switch_context(e.scheduler, t.context);
      finish_switch(e.scheduler_fake_stack, nullptr, nullptr);
      e.current = nullptr;
      if (e.aborted) return;
    }
    if (!ran) {
      set_error(cudaErrorLaunchFailure,
                where_launched() +
                    format(", block (%u,%u,%u): deadlock: %d live threads all wait",
                           e.block_idx.x, e.block_idx.y, e.block_idx.z, e.live) +
                    describe_waiting_threads(),
                true);
      e.aborted = true;
      return;
    }
  }
}

bool valid_dims(const dim3& d, const dim3& limit) {
  return d.x >= 1 && d.y >= 1 && d.z >= 1 && d.x <= limit.x && d.y <= limit.y && d.z <= limit.z;
}

}  // namespace

// ----------------------------------------------------------------- host API

Order order() {
  Emulator& e = emu();
  if (!e.order_read) {
    const char* env = std::getenv("CUDA_EMULATOR_ORDER");
    e.order = env != nullptr && std::strcmp(env, "reverse") == 0 ? Order::kReverse : Order::kForward;
    if (env != nullptr && std::strcmp(env, "reverse") != 0 && std::strcmp(env, "forward") != 0) {
      std::fprintf(stderr, "cuda_emu: CUDA_EMULATOR_ORDER=%s: expected forward or reverse\n", env);
      std::abort();
    }
    e.order_read = true;
  }
  return e.order;
}

void set_order(Order order) {
  emu().order = order;
  emu().order_read = true;
}

std::string last_error_message() { return emu().message; }

void reset() {
  Emulator& e = emu();
  e.sticky = e.last = cudaSuccess;
  e.message.clear();
}

Counts counts() { return emu().counts; }

cudaError_t get_last_error() {
  Emulator& e = emu();
  if (e.sticky != cudaSuccess) return e.sticky;
  const cudaError_t last = e.last;
  e.last = cudaSuccess;
  return last;
}

cudaError_t peek_at_last_error() {
  const Emulator& e = emu();
  return e.sticky != cudaSuccess ? e.sticky : e.last;
}

cudaError_t memset_async(void* ptr, int value, size_t count, cudaStream_t) {
  if (emu().sticky != cudaSuccess) return emu().sticky;
  std::memset(ptr, value, count);
  return cudaSuccess;
}

namespace detail {

void run_grid(const LaunchSite& site, const LaunchConfig& config, size_t param_bytes,
              const std::function<void()>& thread_body) {
  Emulator& e = emu();
  if (e.sticky != cudaSuccess) return;  // the context is lost: nothing runs
  if (e.current != nullptr) {
    std::fprintf(stderr, "cuda_emu: %s:%d launches a kernel from device code\n", site.file,
                 site.line);
    std::abort();
  }
  e.site = &site;
  const unsigned block_threads = config.block.x * config.block.y * config.block.z;
  if (!valid_dims(config.grid, dim3(2147483647u, 65535u, 65535u)) ||
      !valid_dims(config.block, dim3(1024u, 1024u, 64u)) || block_threads > kMaxBlockThreads) {
    set_error(cudaErrorInvalidConfiguration,
              where_launched() + format(": grid (%u,%u,%u), block (%u,%u,%u)", config.grid.x,
                                        config.grid.y, config.grid.z, config.block.x,
                                        config.block.y, config.block.z),
              false);
    return;
  }
  if (param_bytes > kMaxParamBytes) {
    set_error(cudaErrorInvalidValue,
              where_launched() + format(": %zu bytes of kernel parameters, CUDA takes at most %zu",
                                        param_bytes, kMaxParamBytes),
              false);
    return;
  }
  if (config.shared_bytes != 0) {
    set_error(cudaErrorNotSupported,
              where_launched() + ": dynamic shared memory is not emulated (extend the emulator)",
              false);
    return;
  }
  ++e.counts.launches;
  e.body = &thread_body;
  e.grid_dim = config.grid;
  e.block_dim = config.block;
  e.aborted = false;
  const uint64_t blocks = uint64_t{config.grid.x} * config.grid.y * config.grid.z;
  const bool reverse = order() == Order::kReverse;
  for (uint64_t k = 0; k < blocks && !e.aborted; ++k) {
    const uint64_t b = reverse ? blocks - 1 - k : k;
    run_block(dim3(static_cast<unsigned>(b % config.grid.x),
                   static_cast<unsigned>(b / config.grid.x % config.grid.y),
                   static_cast<unsigned>(b / (uint64_t{config.grid.x} * config.grid.y))));
  }
  e.body = nullptr;
}

const uint3& thread_idx() { return emu().current->idx; }
const uint3& block_idx() { return emu().block_idx; }
const dim3& block_dim() { return emu().block_dim; }
const dim3& grid_dim() { return emu().grid_dim; }
int lane_id() { return emu().current->linear % kWarpSize; }

void syncthreads(const char* file, int line) {
  Emulator& e = emu();
  Thread& me = *e.current;
  if (e.barrier_arrived == 0) {
    e.barrier_first = &me;
  } else if (line != e.barrier_first->line || std::strcmp(file, e.barrier_first->file) != 0) {
    fail_on_thread(cudaErrorLaunchFailure,
                   format("__syncthreads at %s:%d while thread (%u,%u,%u) waits at the one at "
                          "%s:%d (every live thread of a block must reach the same barrier)",
                          file, line, e.barrier_first->idx.x, e.barrier_first->idx.y,
                          e.barrier_first->idx.z, e.barrier_first->file, e.barrier_first->line));
  }
  me.state = State::kAtBarrier;
  me.file = file;
  me.line = line;
  ++e.barrier_arrived;
  release_barrier_if_complete();
  if (me.state == State::kAtBarrier) yield();
}

uint64_t shuffle(const char* what, const char* file, int line, unsigned mask, uint64_t value,
                 int source) {
  Emulator& e = emu();
  Thread& me = *e.current;
  const int lane = me.linear % kWarpSize;
  const int warp = me.linear / kWarpSize;
  if (!((mask >> lane) & 1u)) {
    fail_on_thread(cudaErrorLaunchFailure,
                   format("%s at %s:%d: mask 0x%08x leaves out the calling lane %d", what, file,
                          line, mask, lane));
  }
  if (!((mask >> source) & 1u)) {
    fail_on_thread(cudaErrorLaunchFailure,
                   format("%s at %s:%d: lane %d reads lane %d, outside the mask 0x%08x", what,
                          file, line, lane, source, mask));
  }
  const int block_threads = static_cast<int>(e.block_dim.x * e.block_dim.y * e.block_dim.z);
  for (int l = 0; l < kWarpSize; ++l) {
    if (!((mask >> l) & 1u)) continue;
    const int t = warp * kWarpSize + l;
    if (t >= block_threads || e.threads[t].state == State::kExited) {
      fail_on_thread(cudaErrorLaunchFailure,
                     format("%s at %s:%d: mask 0x%08x names lane %d, which %s", what, file, line,
                            mask, l, t >= block_threads ? "the block does not have" : "has returned"));
    }
  }
  // Note [Shuffle rendezvous]: a lane of the mask waiting in another shuffle
  // that needs this lane can never meet it.
  for (int l = 0; l < kWarpSize; ++l) {
    if (!((mask >> l) & 1u)) continue;
    const Thread& t = e.threads[warp * kWarpSize + l];
    if (t.state == State::kAtShuffle && ((t.mask >> lane) & 1u) &&
        !same_shuffle(t, what, file, line, mask)) {
      fail_on_thread(cudaErrorLaunchFailure,
                     format("%s at %s:%d with mask 0x%08x while lanes %s of its warp wait in %s "
                            "at %s:%d with mask 0x%08x",
                            what, file, line, mask, lanes_text(lanes_waiting_with(t)).c_str(),
                            t.what, t.file, t.line, t.mask));
    }
  }
  me.state = State::kAtShuffle;
  me.what = what;
  me.file = file;
  me.line = line;
  me.mask = mask;
  me.value = value;
  me.source = source;
  for (int l = 0; l < kWarpSize; ++l) {
    if (!((mask >> l) & 1u)) continue;
    if (!same_shuffle(e.threads[warp * kWarpSize + l], what, file, line, mask)) {
      yield();  // a lane of the mask is still to come: the last to arrive completes it
      return me.result;
    }
  }
  for (int l = 0; l < kWarpSize; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Thread& t = e.threads[warp * kWarpSize + l];
    t.result = e.threads[warp * kWarpSize + t.source].value;
    t.state = State::kReady;
  }
  return me.result;
}

}  // namespace detail

}  // namespace cuda_emu

extern "C" void cuda_emu_device_assert_fail(const char* assertion, const char* file,
                                            unsigned int line, const char* function) noexcept {
  if (cuda_emu::emu().current == nullptr) {
    // Host code (e.g. the test itself): glibc's assert behaviour.
    std::fprintf(stderr, "%s:%u: %s: Assertion `%s' failed.\n", file, line, function, assertion);
    std::abort();
  }
  cuda_emu::fail_on_thread(cudaErrorAssert, cuda_emu::format("device-side assert `%s' failed at "
                                                             "%s:%u in %s",
                                                             assertion, file, line, function));
}
