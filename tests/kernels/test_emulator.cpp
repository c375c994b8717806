// The CUDA emulator's own tests (Note [CUDA emulator] in
// tests/cuda_emulator/emulator.h), through the probe kernels of
// emulator_probes.cu: each way of breaking the execution model must stop the
// launch with a sticky error naming the kernel, the block, the thread and the
// source line, and the patterns the model allows must run and give CUDA's
// results. The kernel tests trust the emulator to catch what these plant.
//
// A violation is found by whichever thread gets there second, so which
// thread a message names depends on the order threads run in; the cases work
// out the expected one from cuda_emu::order() and run in both orders.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "emulator.h"
#include "emulator_probes.h"
#include "kernel_test.h"

namespace {

using Catch::Matchers::Contains;
using emulator_probes::ShuffleFault;
using emulator_probes::Site;
using emulator_probes::where;

bool forward() { return cuda_emu::order() == cuda_emu::Order::kForward; }

std::string thread(int x) { return "thread (" + std::to_string(x) + ",0,0)"; }

// Sets the order for a scope; the previous one (CUDA_EMULATOR_ORDER's) is
// back afterwards, so the cases after this one run in the order asked for.
class ScopedOrder {
 public:
  explicit ScopedOrder(cuda_emu::Order order) : previous_(cuda_emu::order()) {
    cuda_emu::set_order(order);
  }
  ~ScopedOrder() { cuda_emu::set_order(previous_); }
  ScopedOrder(const ScopedOrder&) = delete;
  ScopedOrder& operator=(const ScopedOrder&) = delete;

 private:
  cuda_emu::Order previous_;
};

}  // namespace

// ------------------------------------------------------------ violations

TEST_CASE("a __syncthreads reached at two lines stops the launch, naming both", "[emulator]") {
  std::vector<int> ran(3 * 32, 0);
  CHECK(emulator_probes::launch_divergent_barrier(ran.data(), 3, 1) == cudaErrorLaunchFailure);
  const std::string message = cuda_emu::last_error_message();
  CAPTURE(message);
  CHECK_THAT(message, Contains("cudaErrorLaunchFailure: kernel divergent_barrier_kernel "));
  // The half that arrives first waits; the first thread of the other half fails.
  if (forward()) {
    CHECK_THAT(message, Contains("block (1,0,0) " + thread(16) + ": __syncthreads at " +
                                 where(Site::kBarrierHigh) + " while " + thread(0) +
                                 " waits at the one at " + where(Site::kBarrierLow) + " ("));
  } else {
    CHECK_THAT(message, Contains("block (1,0,0) " + thread(15) + ": __syncthreads at " +
                                 where(Site::kBarrierLow) + " while " + thread(31) +
                                 " waits at the one at " + where(Site::kBarrierHigh) + " ("));
  }
  // The block run before block 1 finished, block 1 and the one after it did not.
  const int done = forward() ? 0 : 2;
  for (int i = 0; i < 3 * 32; ++i) {
    INFO("thread " << i % 32 << " of block " << i / 32);
    CHECK(ran[i] == (i / 32 == done ? 1 : 0));
  }
  // Sticky: a correct launch afterwards does not run.
  CHECK(cuda_emu::peek_at_last_error() == cudaErrorLaunchFailure);
  std::vector<int> again(32, 0);
  CHECK(emulator_probes::launch_divergent_barrier(again.data(), 1, -1) == cudaErrorLaunchFailure);
  CHECK(again == std::vector<int>(32, 0));
}

TEST_CASE("a barrier that a thread stuck in a shuffle never reaches is a deadlock", "[emulator]") {
  // Returned threads would count as arrived; lane 1 is live, waiting in a
  // shuffle for lane 0, which waits at the barrier for lane 1.
  std::vector<float> out(32, -1.f);
  CHECK(emulator_probes::launch_barrier_shuffle_deadlock(out.data()) == cudaErrorLaunchFailure);
  const std::string message = cuda_emu::last_error_message();
  CAPTURE(message);
  CHECK_THAT(message, Contains("kernel barrier_shuffle_deadlock_kernel "));
  CHECK_THAT(message, Contains("block (0,0,0): deadlock: 32 live threads all wait"));
  CHECK_THAT(message, Contains(thread(0) + " waits in __syncthreads at " +
                               where(Site::kDeadlockBarrier) + ";"));
  CHECK_THAT(message, Contains(thread(1) + " waits in __shfl_xor_sync at " +
                               where(Site::kDeadlockShuffle) + ";"));
  CHECK(out == std::vector<float>(32, -1.f));
  CHECK(cuda_emu::get_last_error() == cudaErrorLaunchFailure);
}

TEST_CASE("a shuffle whose mask breaks the rules stops the launch, naming lane, mask and line",
          "[emulator]") {
  cuda_emu::reset();  // a new run for each section: the main listener resets only the first
  std::vector<float> out(32, -1.f);
  ShuffleFault fault{};
  std::string expected;
  SECTION("a mask that leaves out the calling lane") {
    fault = ShuffleFault::kMaskWithoutCaller;
    expected = thread(3) + ": __shfl_xor_sync at " + where(Site::kShuffleWithoutCaller) +
               ": mask 0x00000001 leaves out the calling lane 3";
  }
  SECTION("a lane that reads a lane outside the mask") {
    fault = ShuffleFault::kReadOutsideMask;
    expected = thread(15) + ": __shfl_down_sync at " + where(Site::kShuffleOutsideMask) +
               ": lane 15 reads lane 16, outside the mask 0x0000ffff";
  }
  SECTION("a mask naming lanes past the end of the block") {
    fault = ShuffleFault::kLaneBeyondBlock;
    expected = thread(forward() ? 0 : 15) + ": __shfl_xor_sync at " +
               where(Site::kShuffleBeyondBlock) +
               ": mask 0xffffffff names lane 16, which the block does not have";
  }
  SECTION("two lanes naming each other at shuffles of different lines") {
    fault = ShuffleFault::kMismatchedShuffles;
    const Site mine = forward() ? Site::kMismatchedShuffleB : Site::kMismatchedShuffleA;
    const Site theirs = forward() ? Site::kMismatchedShuffleA : Site::kMismatchedShuffleB;
    expected = thread(forward() ? 1 : 0) + ": __shfl_xor_sync at " + where(mine) +
               " with mask 0x00000003 while lanes " + (forward() ? "0" : "1") +
               " of its warp wait in __shfl_xor_sync at " + where(theirs) + " with mask 0x00000003";
  }
  CHECK(emulator_probes::launch_faulty_shuffle(fault, out.data()) == cudaErrorLaunchFailure);
  const std::string message = cuda_emu::last_error_message();
  CAPTURE(message);
  CHECK_THAT(message, Contains("cudaErrorLaunchFailure: kernel faulty_shuffle_kernel "));
  CHECK_THAT(message, Contains("block (0,0,0) " + expected));
}

TEST_CASE("a shuffle naming a lane that returns fails, before or after the lane returns",
          "[emulator]") {
  // Which of the two checks finds it depends on the order: both are run.
  for (const cuda_emu::Order order : {cuda_emu::Order::kForward, cuda_emu::Order::kReverse}) {
    const ScopedOrder scoped(order);
    cuda_emu::reset();
    std::vector<float> out(32, -1.f);
    CHECK(emulator_probes::launch_faulty_shuffle(ShuffleFault::kReturnedLane, out.data()) ==
          cudaErrorLaunchFailure);
    const std::string message = cuda_emu::last_error_message();
    CAPTURE(message);
    CHECK_THAT(message, Contains("cudaErrorLaunchFailure: kernel faulty_shuffle_kernel "));
    if (order == cuda_emu::Order::kForward) {
      // Lanes 0-6 wait in the shuffle when lane 7 returns.
      CHECK_THAT(message, Contains("block (0,0,0) " + thread(7) +
                                   ": returned while lanes 0-6 of its warp wait for it in "
                                   "__shfl_xor_sync at " +
                                   where(Site::kShuffleOfReturnedLane) + " (mask 0x000000ff)"));
    } else {
      // Lane 7 has returned when lane 6 calls the shuffle.
      CHECK_THAT(message, Contains("block (0,0,0) " + thread(6) + ": __shfl_xor_sync at " +
                                   where(Site::kShuffleOfReturnedLane) +
                                   ": mask 0x000000ff names lane 7, which has returned"));
    }
  }
}

TEST_CASE("a device assert is sticky until reset and names the line", "[emulator]") {
  std::vector<int> ran(4 * 32, 0);
  CHECK(emulator_probes::launch_device_assert(ran.data(), 4, 2, 5) == cudaErrorAssert);
  const std::string message = cuda_emu::last_error_message();
  CAPTURE(message);
  CHECK_THAT(message, Contains("cudaErrorAssert: kernel device_assert_kernel "));
  CHECK_THAT(message,
             Contains("block (2,0,0) " + thread(5) + ": device-side assert `probe' failed at " +
                      where(Site::kDeviceAssert) + " in fail_assert"));
  CHECK(ran[2 * 32 + 5] == 0);

  // As on a GPU, the context is lost: every query keeps reporting the assert
  // and nothing runs any more.
  CHECK(cuda_emu::get_last_error() == cudaErrorAssert);
  CHECK(cuda_emu::get_last_error() == cudaErrorAssert);
  CHECK(cuda_emu::peek_at_last_error() == cudaErrorAssert);
  std::vector<int> again(32, 7);
  CHECK(cuda_emu::memset_async(again.data(), 0, again.size() * sizeof(int), nullptr) ==
        cudaErrorAssert);
  const int64_t launches = cuda_emu::counts().launches;
  CHECK(emulator_probes::launch_device_assert(again.data(), 1, -1, 0) == cudaErrorAssert);
  CHECK(cuda_emu::counts().launches == launches);
  CHECK(again == std::vector<int>(32, 7));
  CHECK(cuda_emu::last_error_message() == message);

  cuda_emu::reset();
  CHECK(cuda_emu::get_last_error() == cudaSuccess);
  CHECK(cuda_emu::last_error_message().empty());
  REQUIRE_LAUNCH(emulator_probes::launch_device_assert(again.data(), 1, -1, 0));
  CHECK(again == std::vector<int>(32, 1));
}

// ------------------------------------------------------ correct patterns

TEST_CASE("threads that returned count as arrived at a barrier", "[emulator]") {
  // 1: one live thread; 31, 40: a warp partly returned; 64: none returned.
  const int active = GENERATE(1, 31, 32, 40, 64);
  cuda_emu::reset();  // a failed value's sticky error must not fail the next ones
  CAPTURE(active);
  std::vector<int> out(64, -1);
  REQUIRE_LAUNCH(emulator_probes::launch_early_exit_barrier(out.data(), active));
  for (int t = 0; t < 64; ++t) {
    INFO("thread " << t);
    CHECK(out[t] == (t < active ? (t + 1) % active + 1 : -1));
  }
}

TEST_CASE("divergent shuffles with partial masks run", "[emulator]") {
  const bool both_halves = GENERATE(false, true);
  cuda_emu::reset();  // as above
  CAPTURE(both_halves);
  constexpr int kWarps = 4;
  std::vector<float> in(kWarps * 32);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>((i * 37) % 101);  // exact sums
  std::vector<float> half_sum(in.size(), -1.f);
  std::vector<float> warp_sum(in.size(), -1.f);
  REQUIRE_LAUNCH(emulator_probes::launch_divergent_warp_sums(in.data(), kWarps, both_halves,
                                                             half_sum.data(), warp_sum.data()));
  for (int w = 0; w < kWarps; ++w) {
    const float* x = in.data() + w * 32;
    const float low = std::accumulate(x, x + 16, 0.f);
    const float high = std::accumulate(x + 16, x + 32, 0.f);
    for (int lane = 0; lane < 32; ++lane) {
      const float half = lane < 16 ? low : both_halves ? high : x[lane];
      INFO("warp " << w << " lane " << lane);
      CHECK(half_sum[w * 32 + lane] == half);
      CHECK(warp_sum[w * 32 + lane] == (both_halves ? 16 * low + 16 * high : 16 * low + high));
    }
  }
}

TEST_CASE("2-D and 3-D grids and blocks index as CUDA does", "[emulator]") {
  cuda_emu::reset();  // as above
  SECTION("block sums over a 3-D grid of 2-D blocks") {
    const int batch = 2, rows = 9, cols = 37;  // a grid (3, 3, 2), with tails in x and y
    const int gx = 3, gy = 3;
    std::vector<float> in(batch * rows * cols);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>((i * 7) % 101);
    // Sums of whole numbers below 2^24: exact in any order.
    const auto sum_of = [&](int z, int row0, int nrows, int col0) {
      float s = 0.f;
      for (int r = row0; r < std::min(rows, row0 + nrows); ++r) {
        for (int c = col0; c < std::min(cols, col0 + 16); ++c) s += in[(z * rows + r) * cols + c];
      }
      return s;
    };
    std::vector<float> sums(gx * gy * batch, -1.f);
    std::vector<float> warp_sums(batch * gy * 4 * gx * 16, -1.f);
    REQUIRE_LAUNCH(emulator_probes::launch_block_sums_3d(in.data(), batch, rows, cols, sums.data(),
                                                         warp_sums.data()));
    int wrong_warp_sums = 0;
    for (int z = 0; z < batch; ++z) {
      for (int by = 0; by < gy; ++by) {
        for (int bx = 0; bx < gx; ++bx) {
          INFO("block (" << bx << "," << by << "," << z << ")");
          CHECK(sums[(z * gy + by) * gx + bx] == sum_of(z, by * 4, 4, bx * 16));
          for (int ty = 0; ty < 4; ++ty) {
            const float warp_sum = sum_of(z, by * 4 + ty / 2 * 2, 2, bx * 16);
            for (int tx = 0; tx < 16; ++tx) {
              wrong_warp_sums +=
                  warp_sums[((z * gy * 4) + by * 4 + ty) * gx * 16 + bx * 16 + tx] != warp_sum;
            }
          }
        }
      }
    }
    CHECK(wrong_warp_sums == 0);
  }
  SECTION("a transpose over a 2-D grid of 1-D blocks") {
    // Tails in both directions, a single row and a single column.
    const auto [rows, cols] = GENERATE(std::make_pair(70, 45), std::make_pair(1, 33),
                                       std::make_pair(100, 1), std::make_pair(64, 96));
    CAPTURE(rows, cols);
    std::vector<float> in(rows * cols);
    std::iota(in.begin(), in.end(), 0.f);
    std::vector<float> out(rows * cols, -1.f);
    REQUIRE_LAUNCH(emulator_probes::launch_transpose(in.data(), rows, cols, out.data()));
    int wrong = 0;
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) wrong += out[c * rows + r] != in[r * cols + c];
    }
    CHECK(wrong == 0);
  }
}

// ------------------------------------------------------- order and memory

TEST_CASE("a race on shared memory shows in the two orders, and a barrier ends it", "[emulator]") {
  constexpr int kBlocks = 3;
  struct Run {
    std::vector<int> seen;
    std::vector<int> sequence;
  };
  const auto run = [](cuda_emu::Order order, bool with_barrier) {
    const ScopedOrder scoped(order);
    Run r{std::vector<int>(kBlocks, -2), std::vector<int>(kBlocks, -2)};
    REQUIRE_LAUNCH(emulator_probes::launch_shared_race(r.seen.data(), r.sequence.data(), kBlocks,
                                                       with_barrier));
    return r;
  };
  const cuda_emu::Order before = cuda_emu::order();
  const Run racy_forward = run(cuda_emu::Order::kForward, false);
  const Run racy_reverse = run(cuda_emu::Order::kReverse, false);
  const Run forward = run(cuda_emu::Order::kForward, true);
  const Run reverse = run(cuda_emu::Order::kReverse, true);
  CHECK(cuda_emu::order() == before);

  // Without the barrier thread 0 reads the slot before or after thread 1
  // writes it, depending on the order: the kernel tests, run in both, see it.
  CHECK(racy_forward.seen != racy_reverse.seen);
  for (int b = 0; b < kBlocks; ++b) {
    CHECK((racy_forward.seen[b] == -1 || racy_forward.seen[b] == b));
    CHECK((racy_reverse.seen[b] == -1 || racy_reverse.seen[b] == b));
  }
  const std::vector<int> block_ids = {0, 1, 2};
  CHECK(forward.seen == block_ids);
  CHECK(reverse.seen == block_ids);
  // Blocks run in index order or reversed.
  CHECK(forward.sequence == block_ids);
  CHECK(reverse.sequence == std::vector<int>{2, 1, 0});
}

TEST_CASE("shared memory is per block and per function instantiation", "[emulator]") {
  std::vector<int> out(4 * 64 * 3, -1);
  REQUIRE_LAUNCH(emulator_probes::launch_shared_per_block(out.data()));
  int wrong = 0;
  for (int b = 0; b < 4; ++b) {
    for (int t = 0; t < 64; ++t) {
      const int* mine = out.data() + (b * 64 + t) * 3;
      wrong += mine[0] != b || mine[1] != 10 + b || mine[2] != 20 + b;
    }
  }
  CHECK(wrong == 0);
}

TEST_CASE("launch counts count what ran; a bad configuration is refused, not sticky",
          "[emulator]") {
  const cuda_emu::Counts before = cuda_emu::counts();
  std::vector<int> marks(3 * 2 * 64, 0);
  REQUIRE_LAUNCH(emulator_probes::launch_mark_threads(marks.data(), dim3(3, 2, 1), dim3(8, 4, 2)));
  const cuda_emu::Counts after = cuda_emu::counts();
  CHECK(after.launches == before.launches + 1);
  CHECK(after.blocks == before.blocks + 6);
  CHECK(after.threads == before.threads + 6 * 64);
  CHECK(marks == std::vector<int>(marks.size(), 1));  // every thread once

  // What a GPU refuses with cudaErrorInvalidConfiguration: empty grids and
  // blocks, more than 1024 threads a block, a dimension past its limit.
  const std::vector<std::pair<dim3, dim3>> refused = {
      {dim3(0), dim3(32)},        {dim3(4, 0), dim3(32)},       {dim3(1), dim3(0)},
      {dim3(1), dim3(1025)},      {dim3(1), dim3(32, 33)},      {dim3(1), dim3(1, 1, 65)},
      {dim3(1, 65536), dim3(32)}, {dim3(1, 1, 65536), dim3(32)}};
  for (const auto& [grid, block] : refused) {
    const std::string config = "grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) +
                               "," + std::to_string(grid.z) + "), block (" +
                               std::to_string(block.x) + "," + std::to_string(block.y) + "," +
                               std::to_string(block.z) + ")";
    INFO(config);
    CHECK(emulator_probes::launch_mark_threads(nullptr, grid, block) ==
          cudaErrorInvalidConfiguration);
    CHECK_THAT(cuda_emu::last_error_message(),
               Contains("cudaErrorInvalidConfiguration: kernel mark_threads_kernel "));
    CHECK_THAT(cuda_emu::last_error_message(), Contains(": " + config));
    // Reported once, by the launcher's cudaGetLastError: not sticky.
    CHECK(cuda_emu::get_last_error() == cudaSuccess);
    const cuda_emu::Counts now = cuda_emu::counts();
    CHECK(now.launches == after.launches);
    CHECK(now.blocks == after.blocks);
    CHECK(now.threads == after.threads);
  }

  // The limits themselves are accepted.
  std::vector<int> full(1024, 0);
  REQUIRE_LAUNCH(emulator_probes::launch_mark_threads(full.data(), dim3(1), dim3(1024)));
  CHECK(full == std::vector<int>(1024, 1));
  CHECK(cuda_emu::counts().threads == after.threads + 1024);
}
