// Tests of the LD_PRELOAD interposer (libstreamsafe_preload.so) through a child process:
// examples/preload/loop, a plain CUDA program built with -cudart shared, runs with and without
// LD_PRELOAD. Without a GPU both runs must behave the same (every call passes through); on a
// GPU the checksums must agree. The cudaFree contract and the driver allocations on the GPU,
// and the CUB example: examples_gpu_test.cpp.
#include "support/command.hpp"
#include "support/gpu.hpp"

#include <catch2/catch.hpp>

#include <string>

using namespace streamsafe::test;

#if defined(STREAMSAFE_PRELOAD_LOOP_PATH) && defined(STREAMSAFE_PRELOAD_LIB_PATH)

TEST_CASE("The interposer loads into a plain CUDA program and leaves its results unchanged",
          "[preload]") {
  const std::string loop = std::string("'") + STREAMSAFE_PRELOAD_LOOP_PATH + "' --iterations 300";
  const command_result plain = run_command(loop);
  const command_result preloaded = run_command(std::string("LD_PRELOAD='") +
                                               STREAMSAFE_PRELOAD_LIB_PATH + "' " + loop);
  INFO("without:\n" << plain.output << "with:\n" << preloaded.output);
  CHECK(plain.status == preloaded.status);
  if (streamsafe::test::gpu_count() == 0) {
    // No GPU: every call went to the runtime, which answered the same both times.
    CHECK(plain.status == 2);
    CHECK(plain.output == preloaded.output);
    return;
  }
  CHECK(plain.status == 0);
  CHECK_FALSE(line_starting(plain.output, "checksum:").empty());
  CHECK(line_starting(plain.output, "checksum:") == line_starting(preloaded.output, "checksum:"));
}

#endif
