// Test support: blocking_host_backend, a simulated device whose host-blocking calls block the
// calling thread, as a GPU's do (case K8).
//
// sim::simulated_device refuses a host wait that an unopened hold blocks (backend_error, "would
// never complete"), because one thread would wait for ever. This backend forwards every call to
// a simulated device, except that synchronize_event / synchronize_device (and free_segment when
// it models cudaFree's device-wide wait), when a hold blocks them, retry every millisecond until
// another thread opens the hold; after `limit` they give up with backend_error ("still blocked
// after ... ms: the host would hang"), so that a test fails instead of hanging. It notes which
// stream each host wait was on (the stream the event was last recorded on) and whether a thread is
// blocked in one now.
//
// Thread safety: every call may come from any thread (the simulated device has one mutex; the
// notes have their own).
#pragma once

#include <streamsafe/backends/forwarding_backend.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/sim/simulated_device.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace streamsafe::test {

class blocking_host_backend final : public forwarding_backend {
 public:
  // A host wait on the device (synchronize_device), in waited_streams().
  static constexpr stream_handle k_whole_device = ~stream_handle{0};

  explicit blocking_host_backend(sim::simulated_device& dev,
                                 std::chrono::milliseconds limit = std::chrono::seconds(30))
      : forwarding_backend(dev), dev_(dev), limit_(limit) {}

  // The streams the host waited on, one entry per host-blocking call, in call order.
  std::vector<stream_handle> waited_streams() const {
    std::lock_guard<std::mutex> lk(mu_);
    return waited_;
  }
  std::size_t blocking_calls() const {
    std::lock_guard<std::mutex> lk(mu_);
    return waited_.size();
  }
  // Host waits that had to block (a hold stood in their way).
  std::size_t blocked_calls() const { return blocked_calls_.load(); }
  // True while a thread is blocked in a host wait behind a hold.
  bool blocked_now() const { return blocked_now_.load() != 0; }
  // Waits (up to `limit`) until a thread is blocked in a host wait; false when none blocked.
  bool wait_until_blocked(std::chrono::milliseconds limit) const {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!blocked_now()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

  // With sim::device_config::free_segment_synchronizes (a model of cudaFree) this is a host wait
  // on the whole device too.
  void free_segment(void* base, std::size_t size_bytes) override {
    if (!dev_.free_segment_synchronizes()) return dev_.free_segment(base, size_bytes);
    {
      std::lock_guard<std::mutex> lk(mu_);
      waited_.push_back(k_whole_device);
    }
    block_until([&] { dev_.free_segment(base, size_bytes); }, "free_segment");
  }
  void record_event(event_handle event, stream_handle stream) override {
    dev_.record_event(event, stream);
    std::lock_guard<std::mutex> lk(mu_);
    recorded_on_[event] = stream;
  }
  void synchronize_event(event_handle event) override {
    stream_handle stream = k_whole_device;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (auto it = recorded_on_.find(event); it != recorded_on_.end()) stream = it->second;
      waited_.push_back(stream);
    }
    block_until([&] { dev_.synchronize_event(event); }, "synchronize_event");
  }
  void synchronize_device() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      waited_.push_back(k_whole_device);
    }
    block_until([&] { dev_.synchronize_device(); }, "synchronize_device");
  }

 private:
  template <class Wait>
  void block_until(Wait wait, const char* what) {
    const auto start = std::chrono::steady_clock::now();
    bool blocked = false;
    for (;;) {
      try {
        wait();
        break;
      } catch (const backend_error& e) {
        if (std::string(e.what()).find("would never complete") == std::string::npos) {
          if (blocked) blocked_now_.fetch_sub(1);
          throw;
        }
      }
      if (!blocked) {
        blocked = true;
        blocked_now_.fetch_add(1);
        blocked_calls_.fetch_add(1);
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited >= limit_) {
        blocked_now_.fetch_sub(1);
        throw backend_error(
            std::string("blocking_host_backend: ") + what + " still blocked after " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(waited).count()) +
            " ms: the host would hang");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (blocked) blocked_now_.fetch_sub(1);
  }

  sim::simulated_device& dev_;
  const std::chrono::milliseconds limit_;
  mutable std::mutex mu_;
  std::map<event_handle, stream_handle> recorded_on_;  // guarded by mu_
  std::vector<stream_handle> waited_;                  // guarded by mu_
  std::atomic<int> blocked_now_{0};
  std::atomic<std::size_t> blocked_calls_{0};
};

// returns_within(call, limit, unblock): runs `call` on a worker thread; if it has not returned
// after `limit`, `unblock` runs (it opens whatever the call waits on, so that the worker can
// finish) and the answer says it timed out, so that a test fails instead of hanging. The worker
// is always joined; an exception from `call` is kept as text.
struct watchdog_result {
  bool returned_in_time = false;
  std::string error;  // what() of an exception the call threw, empty when none
};

inline watchdog_result returns_within(const std::function<void()>& call,
                                      std::chrono::milliseconds limit,
                                      const std::function<void()>& unblock) {
  std::atomic<bool> done{false};
  watchdog_result r;
  std::thread worker([&] {
    try {
      call();
    } catch (const std::exception& e) {
      r.error = e.what();
    } catch (...) {
      r.error = "unknown exception";
    }
    done.store(true);
  });
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done.load() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  r.returned_in_time = done.load();
  if (!r.returned_in_time) unblock();
  worker.join();
  return r;
}

}  // namespace streamsafe::test
