// Catch2's main for the kernel tests, and a listener that clears the
// emulator's errors before each test case, so that a kernel failing one case
// (a sticky error, as on a GPU) does not fail the cases after it.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include "emulator.h"

namespace {

struct ResetEmulator : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  void testCaseStarting(const Catch::TestCaseInfo&) override { cuda_emu::reset(); }
};

}  // namespace

CATCH_REGISTER_LISTENER(ResetEmulator)
