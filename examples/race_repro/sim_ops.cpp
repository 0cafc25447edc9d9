// race_repro: device_ops on the simulated device. Kernels are work items over the same address
// ranges as on the GPU; their durations follow a bandwidth model of the H200 (about 4.3 TB/s
// copy bandwidth, measured there) and every launch costs the host 2.5 us, so per-parameter
// launches leave a queue behind as they do on the GPU.
#include "ops.hpp"

#include <streamsafe/sim/simulated_device.hpp>

#include <algorithm>

namespace race_repro {
namespace {

namespace sim = streamsafe::sim;
using streamsafe::stream_handle;

constexpr double k_bytes_per_us = 4.3e6;  // 4.3 TB/s
constexpr std::uint64_t k_host_launch_us = 3;
constexpr std::uint64_t k_min_kernel_us = 3;
constexpr std::size_t k_chunk = 65536, k_max_chunks = 320;

std::uint64_t kernel_us(double bytes) {
  return std::max<std::uint64_t>(k_min_kernel_us,
                                 static_cast<std::uint64_t>(bytes / k_bytes_per_us));
}

sim::range rd(const void* p, std::size_t bytes) {
  return {reinterpret_cast<std::uintptr_t>(p), bytes, sim::access::read, std::nullopt};
}
sim::range wr(const void* p, std::size_t bytes) {
  return {reinterpret_cast<std::uintptr_t>(p), bytes, sim::access::write, std::nullopt};
}

class sim_ops final : public device_ops {
 public:
  sim_ops() : dev_(config()) { event_ = dev_.create_event(); }

  static sim::device_config config() {
    sim::device_config c;
    c.total_bytes = std::size_t{140} << 30;
    return c;
  }
  streamsafe::device_backend& backend() override { return dev_; }
  stream_handle new_stream() override { return dev_.create_stream(); }
  void init_tensor(void* p, std::size_t bytes, stream_handle s) override {
    launch(s, kernel_us(static_cast<double>(bytes)), {wr(p, bytes)}, "init");
  }
  void write_gradient(float* g, std::size_t n, stream_handle s) override {
    launch(s, kernel_us(static_cast<double>(n * 4)), {wr(g, n * 4)}, "reduce_scatter(grad)");
  }
  void optimizer_step(optimizer_kind kind, const std::vector<tensor>& tensors, int,
                      stream_handle s) override {
    if (kind == optimizer_kind::signsgd_per_parameter) {
      for (const auto& t : tensors) {
        launch(s, kernel_us(12.0 * static_cast<double>(t.n)),
               {wr(t.param, t.n * 4), rd(t.grad, t.n * 4)}, "signsgd_step");
      }
      return;
    }
    // Foreach: a launch carries up to 320 chunks of 65536 elements (multi-tensor apply).
    const bool adamw = kind == optimizer_kind::adamw_foreach;
    const double bytes_per_elem = adamw ? 28.0 : 12.0;
    std::vector<sim::range> ranges;
    std::size_t chunks = 0, elems = 0;
    auto flush = [&] {
      if (ranges.empty()) return;
      launch(s, kernel_us(bytes_per_elem * static_cast<double>(elems)), ranges,
             adamw ? "adamw_foreach" : "signsgd_foreach");
      ranges.clear();
      chunks = elems = 0;
    };
    for (const auto& t : tensors) {
      ranges.push_back(wr(t.param, t.n * 4));
      ranges.push_back(rd(t.grad, t.n * 4));
      if (adamw) {
        ranges.push_back(wr(t.exp_avg, t.n * 4));
        ranges.push_back(wr(t.exp_avg_sq, t.n * 4));
      }
      chunks += (t.n + k_chunk - 1) / k_chunk;
      elems += t.n;
      if (chunks >= k_max_chunks) flush();
    }
    flush();
  }
  void stream_wait(stream_handle waiter, stream_handle on) override {
    dev_.record_event(event_, on);
    dev_.stream_wait_event(waiter, event_);
  }
  void spin(stream_handle s, double ms) override {
    launch(s, static_cast<std::uint64_t>(ms * 1000), {}, "unrelated kernel");
  }
  void synchronize_device() override { dev_.synchronize_device(); }
  std::string finish_stream(stream_handle s) override {
    dev_.record_event(event_, s);
    dev_.synchronize_event(event_);
    return sim_fault_summary(*this);
  }
  double now_ms() override { return static_cast<double>(dev_.now_us()) / 1000.0; }

  sim::simulated_device dev_;

 private:
  void launch(stream_handle s, std::uint64_t us, std::vector<sim::range> ranges,
              const char* label) {
    dev_.advance(k_host_launch_us);
    dev_.launch(s, us, std::move(ranges), label);
  }
  streamsafe::event_handle event_ = 0;
};

}  // namespace

std::unique_ptr<device_ops> make_sim_ops() { return std::make_unique<sim_ops>(); }

std::string sim_fault_summary(device_ops& ops) {
  auto& dev = static_cast<sim_ops&>(ops).dev_;
  const auto faults = dev.faults();
  if (faults.empty()) return {};
  std::string text = std::string("simulated ") + sim::to_string(faults.front().kind) + " (" +
                     std::to_string(faults.size()) + " fault(s)): " + faults.front().message;
  return text.size() > 300 ? text.substr(0, 297) + "..." : text;
}

}  // namespace race_repro
