// race_repro: the failing FSDP2 training step, written once over a small device interface so
// that the same step runs on the GPU (real kernels) and on the simulated device.
//
// The step: gradients are allocated on a reduce-scatter stream in backward order (last layer
// first) and written there; the compute
// stream waits for them and runs the optimizer, which reads them WITHOUT record_stream (as
// FSDP2 does); the host frees them (zero_grad) and calls empty_cache right away.
#pragma once

#include <streamsafe/core/caching_allocator.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace race_repro {

enum class optimizer_kind { signsgd_per_parameter, signsgd_foreach, adamw_foreach };
enum class release_variant {
  pytorch,              // release_fence:allocation_stream (PyTorch expandable segments)
  pytorch_synchronize,  // the same after a device-wide synchronize (the field's fix)
  streamsafe_wait,      // streamsafe's default: all_streams fence, empty_cache waits on it
  streamsafe_defer,     // all_streams fence, empty_cache defers what is not yet safe
};

const char* to_string(optimizer_kind k);
const char* to_string(release_variant v);
bool parse(const std::string& s, optimizer_kind& out);
bool parse(const std::string& s, release_variant& out);

struct problem {
  int params = 1536;  // parameter tensors (one launch each per-parameter)
  std::size_t shard_floats = std::size_t{4} << 20;  // elements per tensor
  int steps = 4;
  double unrelated_ms = 0;  // a kernel this long on a third stream each step
};

struct tensor {
  void* param = nullptr;
  float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::size_t n = 0;
};

// What the step needs from a device.
class device_ops {
 public:
  virtual ~device_ops() = default;
  virtual streamsafe::device_backend& backend() = 0;
  virtual streamsafe::stream_handle new_stream() = 0;
  virtual void init_tensor(void* p, std::size_t bytes, streamsafe::stream_handle s) = 0;
  virtual void write_gradient(float* g, std::size_t n, streamsafe::stream_handle s) = 0;
  virtual void optimizer_step(optimizer_kind kind, const std::vector<tensor>& tensors, int step,
                              streamsafe::stream_handle s) = 0;
  virtual void stream_wait(streamsafe::stream_handle waiter, streamsafe::stream_handle on) = 0;
  virtual void spin(streamsafe::stream_handle s, double ms) = 0;
  virtual void synchronize_device() = 0;
  // Waits for the stream; returns "" or the error (CUDA error text, simulated fault).
  virtual std::string finish_stream(streamsafe::stream_handle s) = 0;
  virtual double now_ms() = 0;
};

struct run_result {
  bool clean = true;
  std::string outcome = "clean";
  int steps_completed = 0;
  double median_step_ms = 0;
  double median_empty_cache_ms = 0;
  std::uint64_t bytes_released = 0;
  std::uint64_t releases_deferred = 0;
  std::uint64_t fence_waits = 0;
  std::uint64_t device_syncs = 0;
  // Leak check over long runs: the largest per-step peak of reserved bytes in the first half of
  // the steps (after step 1, the warm-up) and in the second half; bytes still allocated after the
  // last step minus after step 1 (0 when nothing leaks).
  std::uint64_t peak_reserved_first_half = 0;
  std::uint64_t peak_reserved_second_half = 0;
  std::int64_t allocated_drift = 0;
};

run_result run(device_ops& ops, optimizer_kind kind, release_variant variant, const problem& p);

// Line format between the child process and the parent.
std::string encode(const run_result& r);
bool decode(const std::string& line, run_result& r);

}  // namespace race_repro
