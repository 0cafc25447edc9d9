// Catch2 main. The "streamsafe" logger is quiet in tests (errors and the unsafe-scope warnings
// are expected there) unless STREAMSAFE_LOG_LEVEL asks for it.
#define CATCH_CONFIG_RUNNER
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <catch2/catch.hpp>

#include <cstdlib>

int main(int argc, char* argv[]) {
  // [gpu] tests create many streams in one process; with the default 8 hardware connections,
  // unrelated streams can share a queue and serialise, which would blur "waits for exactly the
  // fenced streams". Must be set before CUDA initialises.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // CUDA loads kernels lazily by default; loading one while another kernel runs waits for that
  // kernel (measured on the H200: a fence wait took the full 1 s of an unrelated kernel because
  // the first launch_fill of the process loaded its module). Tests about concurrency load eagerly.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  auto logger = spdlog::stderr_color_mt("streamsafe");
  const char* level = std::getenv("STREAMSAFE_LOG_LEVEL");
  logger->set_level(level && *level ? spdlog::level::from_str(level) : spdlog::level::off);
  return Catch::Session().run(argc, argv);
}
