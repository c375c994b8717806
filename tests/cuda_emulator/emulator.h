// A CPU emulator of the CUDA subset fusetrain's kernels use: the host side
// (what the kernel tests call) and the launch machinery that the rewritten
// `kernel<<<grid, block, shared, stream>>>(args)` syntax expands to.
//
// Note [CUDA emulator]
// Each thread of a block is a fiber with a stack of its own;
// blocks run one after another on the calling thread. A fiber runs until it
// waits (`__syncthreads`, a warp shuffle) or returns; the scheduler then runs
// the next ready one, in index order or reversed (CUDA_EMULATOR_ORDER), so a
// kernel that needs a barrier it does not have gives different results in the
// two orders. `__syncthreads` is a counting barrier over the threads still
// running (a thread that has returned counts as arrived, as on Volta and
// later); a shuffle waits only for the lanes its mask names. What breaks the
// execution model stops the launch with a sticky error naming the kernel, the
// block, the thread and the source line: a barrier reached at different lines,
// a shuffle whose mask leaves out the caller or the lane it reads, a lane of
// the mask that has returned, two lanes each waiting for the other in
// different shuffles, a deadlock (every live thread waits), a device assert.
// A warp may have several shuffles pending at once (Note [Shuffle rendezvous]
// in emulator.cpp). Launches run synchronously on the calling thread; streams
// are accepted and ignored, so stream order is always kept.
//
// What this verifies: the kernels' logic and indexing, tails and alignment
// branches, block and warp reductions, barrier and shuffle discipline, and
// (in the -fsanitize=address,undefined build) memory safety and misaligned
// vector accesses. What it does not: speed, the GPU's memory model and races
// between threads that the fiber order happens to serialise (atomics are
// trivially atomic here), reads of shared memory never written, CUDA graphs,
// streams, NCCL, and the ATen glue in csrc/ops/cuda (it compiles only with
// nvcc). Device math differs by about an ulp: `__expf` is the host's expf
// (the GPU's is ex2.approx-based, within 2 ulp), and the host compiler does
// not contract a * b + c into an FMA where nvcc does.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace cuda_emu {

/// The order blocks run in, and threads of a block are first scheduled in.
enum class Order { kForward, kReverse };

/// Defaults to CUDA_EMULATOR_ORDER ("forward" or "reverse") at the first call.
Order order();
void set_order(Order order);

/// The error of the last failed launch or call (empty when none), with what
/// failed where. Kept until reset().
std::string last_error_message();

/// Clears every error, the sticky one included. Test isolation only: after a
/// device assert CUDA leaves the context unusable until the process exits.
void reset();

/// Counts since the process started: launches run, blocks and threads
/// executed (tests check that a launch really ran, or was refused).
struct Counts {
  int64_t launches = 0;
  int64_t blocks = 0;
  int64_t threads = 0;
};
Counts counts();

// The CUDA runtime calls kernels make (kernel_language.h maps the names).
cudaError_t get_last_error();
cudaError_t peek_at_last_error();
cudaError_t memset_async(void* ptr, int value, size_t count, cudaStream_t stream);

/// Where a launch is written, for messages: the kernel expression, its file
/// and line, and the launching function's signature (its template arguments
/// name the instantiation).
struct LaunchSite {
  const char* kernel;
  const char* file;
  int line;
  const char* caller;
};

struct LaunchConfig {
  LaunchConfig(dim3 grid, dim3 block, size_t shared_bytes = 0, cudaStream_t stream = nullptr)
      : grid(grid), block(block), shared_bytes(shared_bytes), stream(stream) {}
  dim3 grid;
  dim3 block;
  size_t shared_bytes;
  cudaStream_t stream;
};

namespace detail {
/// Runs `thread_body` once per thread of every block (Note [CUDA emulator]).
void run_grid(const LaunchSite& site, const LaunchConfig& config, size_t param_bytes,
              const std::function<void()>& thread_body);
}  // namespace detail

/// `kernel<<<config>>>(args...)`, as rewrite_launches.py writes it: `call`
/// invokes the kernel with the arguments. They are evaluated once, here, and
/// each thread receives its own copy as the kernel's by-value parameters.
template <typename Call, typename... Args>
void launch(const LaunchSite& site, const LaunchConfig& config, Call call, Args&&... args) {
  const std::tuple<std::decay_t<Args>...> params(std::forward<Args>(args)...);
  const size_t param_bytes = (size_t{0} + ... + sizeof(std::decay_t<Args>));
  detail::run_grid(site, config, param_bytes, [&] { std::apply(call, params); });
}

}  // namespace cuda_emu
