// Test support: the simulated device where one handle, k_per_thread (cudaStreamPerThread's
// value, 2), names a different stream in every host thread, as the CUDA runtime does; the
// allocator over it (per_thread_env); and a check that no fault happens around a held stream.
#pragma once

#include "support/forwarding_device.hpp"
#include "support/sim_faults.hpp"
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>

namespace streamsafe::test {

constexpr stream_handle k_per_thread = 2;  // cudaStreamPerThread

class per_thread_device final : public forwarding_device {
 public:
  using forwarding_device::forwarding_device;
  // The calling thread's per-thread stream (created on first use). Threads are told apart by a
  // number of their own: std::thread::id values are reused once a thread has been joined.
  stream_handle own_stream() {
    static std::atomic<int> next_thread{0};
    thread_local const int me = next_thread.fetch_add(1);
    std::lock_guard<std::mutex> lk(mu_);
    auto [it, fresh] = streams_.try_emplace(me, 0);
    if (fresh) it->second = dev_.create_stream();
    return it->second;
  }
  // The legacy default stream (0) is ordered both ways with every blocking stream, and every
  // per-thread stream is one: an action on 0 first waits for the per-thread streams' work so
  // far, and their later work waits for it (CUDA's "Stream synchronization behavior"). The core
  // relies on it to fence another thread's per-thread stream, which only that thread can name.
  void record_event(event_handle e, stream_handle s) override {
    if (s == 0) legacy_waits_for_blocking();
    dev_.record_event(e, resolve(s));
    if (s == 0) blocking_wait_for(e);
  }
  void stream_wait_event(stream_handle s, event_handle e) override {
    if (s == 0) legacy_waits_for_blocking();
    dev_.stream_wait_event(resolve(s), e);
    if (s == 0) blocking_wait_for(e);
  }
  bool query_stream(stream_handle s) override { return dev_.query_stream(resolve(s)); }
  std::uint64_t legacy_actions() const { return legacy_actions_; }
  bool stream_is_capturing(stream_handle s) noexcept override {
    return dev_.stream_is_capturing(resolve(s));
  }
  std::uint64_t capture_id(stream_handle s) noexcept override {
    return dev_.capture_id(resolve(s));
  }
  std::vector<std::uintptr_t> capture_position(stream_handle s) override {
    return dev_.capture_position(resolve(s));
  }
  bool capture_follows(stream_handle s, const std::vector<std::uintptr_t>& p) override {
    return dev_.capture_follows(resolve(s), p);
  }
  bool stream_is_per_thread(stream_handle s) const noexcept override { return s == k_per_thread; }

 private:
  stream_handle resolve(stream_handle s) { return s == k_per_thread ? own_stream() : s; }
  void legacy_waits_for_blocking() {
    std::lock_guard<std::mutex> lk(mu_);
    ++legacy_actions_;
    for (auto& [thread, stream] : streams_) {
      auto [it, fresh] = marks_.try_emplace(stream, 0);
      if (fresh) it->second = dev_.create_event();
      dev_.record_event(it->second, stream);
      dev_.stream_wait_event(0, it->second);
    }
  }
  void blocking_wait_for(event_handle e) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [thread, stream] : streams_) dev_.stream_wait_event(stream, e);
  }
  std::mutex mu_;
  std::map<int, stream_handle> streams_;
  std::map<stream_handle, event_handle> marks_;  // one event per per-thread stream
  std::uint64_t legacy_actions_ = 0;
};

struct per_thread_env {
  sim::simulated_device dev{sim_config()};
  per_thread_device backend{dev};
  caching_allocator alloc{backend, options{}};
};

// No fault while the hold keeps a stream busy, none once it opens and everything has run.
inline void check_no_fault_around(sim::simulated_device& dev, std::uint64_t hold) {
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
  dev.open(hold);
  dev.run_until_idle();
  INFO(fault_text(dev));
  CHECK(dev.fault_count() == 0);
}

}  // namespace streamsafe::test
