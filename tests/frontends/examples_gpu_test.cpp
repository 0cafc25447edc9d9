// The example programs on the GPU, each run as a child process: the C example, the
// LD_PRELOAD interposer over a plain CUDA program (examples/preload/loop), the CUB, Thrust and
// cuda::mr example. Their host tests: capi_test.cpp, frontend_preload_test.cpp.
#include "support/command.hpp"
#include "support/gpu.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

using namespace streamsafe::test;

#ifdef STREAMSAFE_C_EXAMPLE_PATH
TEST_CASE("On the GPU, the C example program passes all its checks", "[gpu][capi]") {
  STREAMSAFE_REQUIRE_GPU();
  const std::string cmd = std::string("'") + STREAMSAFE_C_EXAMPLE_PATH + "' 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  char buf[512];
  while (std::fgets(buf, sizeof buf, pipe)) output += buf;
  const int status = pclose(pipe);
  INFO(output);
  CHECK(status == 0);
  CHECK_THAT(output, Catch::Contains("on the GPU") && Catch::Contains("all checks passed"));
}
#endif

#if defined(STREAMSAFE_PRELOAD_LOOP_PATH) && defined(STREAMSAFE_PRELOAD_LIB_PATH)
TEST_CASE(
    "On the GPU, the interposer keeps the cudaFree contract with far fewer driver allocations",
    "[gpu][preload]") {
  STREAMSAFE_REQUIRE_GPU();
  const command_result r = run_command(std::string("LD_PRELOAD='") + STREAMSAFE_PRELOAD_LIB_PATH +
                                       "' '" + STREAMSAFE_PRELOAD_LOOP_PATH +
                                       "' --iterations 1000");
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(line_starting(r.output, "contract:"), Catch::EndsWith(": ok"));
  const std::string stats = line_starting(r.output, "interposer: {");
  REQUIRE_FALSE(stats.empty());
  CHECK(json_number(stats, "cudaMalloc") > 1000);
  CHECK(json_number(stats, "passthrough_allocs") == 0);
  CHECK(json_number(stats, "errors") == 0);
  const long long driver = json_number(stats, "num_device_alloc");
  CHECK(driver > 0);
  CHECK(driver * 20 < json_number(stats, "cudaMalloc") + json_number(stats, "cudaMallocAsync"));
  // One event per fenced stream per batch, not per free: at most one batch per allocation call.
  CHECK(json_number(stats, "free_batches") <=
        json_number(stats, "cudaMalloc") + json_number(stats, "cudaMallocAsync"));
}
#endif

#ifdef STREAMSAFE_CUB_EXAMPLE_PATH
TEST_CASE("On the GPU, CUB, Thrust and cuda::mr run with temporary storage from streamsafe",
          "[gpu][adapters]") {
  STREAMSAFE_REQUIRE_GPU();
  const command_result r = run_command(std::string("'") + STREAMSAFE_CUB_EXAMPLE_PATH +
                                       "' --iterations 50");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("cub example: all checks passed"));
}
#endif
