// Threads: 12 worker threads do random operations on one allocator over one simulated device:
// allocate and free on their own stream and on 3 shared streams, uses on the shared streams
// (recorded with record_stream), stream-ordered frees, blocks handed to another thread and freed
// there; a maintenance thread meanwhile calls empty_cache (both modes), reclaim, stats,
// largest_free_block_bytes, check_invariants and advances the device clock. A watchdog aborts
// the process with a message if the run does not finish in time (a deadlock). At the end the
// invariants hold, every byte comes back, and the simulated device saw no fault.
//
// Run it under ThreadSanitizer with the tsan preset (see .ci/sanitizers.sh); it must be clean.
#include "support/sim_fixture.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;

namespace {

constexpr int k_workers = 12;
constexpr int k_shared_streams = 3;

struct live {
  void* ptr;
  std::size_t size;
  stream_handle stream;
  std::vector<stream_handle> users;
};

// Blocks handed from one thread to another, to be freed there.
struct mailbox {
  std::mutex mu;
  std::deque<live> blocks;
  void put(live b) {
    std::lock_guard<std::mutex> lk(mu);
    blocks.push_back(std::move(b));
  }
  bool take(live& b) {
    std::lock_guard<std::mutex> lk(mu);
    if (blocks.empty()) return false;
    b = std::move(blocks.front());
    blocks.pop_front();
    return true;
  }
};

// Aborts the process (a test that deadlocked must not hang CI) unless disarmed in time.
class watchdog {
 public:
  watchdog(std::chrono::seconds limit, std::string what) : what_(std::move(what)) {
    thread_ = std::thread([this, limit] {
      std::unique_lock<std::mutex> lk(mu_);
      if (!cv_.wait_for(lk, limit, [this] { return done_; })) {
        std::fprintf(
            stderr, "\nWATCHDOG: %s did not finish within %lld s: deadlock or livelock; aborting\n",
            what_.c_str(), static_cast<long long>(limit.count()));
        std::fflush(stderr);
        std::abort();
      }
    });
  }
  ~watchdog() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

 private:
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

struct outcome {
  std::uint64_t ops = 0, allocations = 0, ooms = 0, handed_over = 0, maintenance = 0;
  std::string error;  // the first unexpected exception or property breach
};

outcome stress(backend_kind backend, empty_cache_mode mode, int ops_per_worker) {
  sim::simulated_device dev(sim_config(4 * GiB));
  options o = make_options(backend, fence_scope::all_streams, mode);
  o.memory_limit_bytes = 768 * MiB;
  o.expandable_chunk_bytes = 2 * MiB;
  caching_allocator alloc(dev, o);

  std::vector<stream_handle> own, shared;
  for (int i = 0; i < k_workers; ++i) own.push_back(dev.create_stream());
  for (int i = 0; i < k_shared_streams; ++i) shared.push_back(dev.create_stream());
  // The all_streams fence covers the streams the allocator has seen.
  for (stream_handle s : own) alloc.deallocate(alloc.allocate(512, s));
  for (stream_handle s : shared) alloc.deallocate(alloc.allocate(512, s));

  mailbox box;
  std::mutex error_mu;
  outcome total;
  std::atomic<bool> failed{false};
  std::atomic<int> running{k_workers};
  auto fail = [&](const std::string& what) {
    std::lock_guard<std::mutex> lk(error_mu);
    if (total.error.empty()) total.error = what;
    failed = true;
  };
  // Orders stream `waiter` after the work enqueued so far on `on` (the program's own ordering).
  auto order_after = [&](stream_handle waiter, stream_handle on) {
    if (waiter == on) return;
    event_handle e = dev.create_event();
    dev.record_event(e, on);
    dev.stream_wait_event(waiter, e);
    dev.destroy_event(e);
  };

  auto worker = [&](int id) {
    std::mt19937_64 rng(0x5151u + static_cast<std::uint64_t>(id));
    auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
    std::vector<live> mine;
    outcome out;
    auto free_one = [&](live b, bool stream_ordered) {
      if (stream_ordered) {
        const stream_handle t = shared[pick(shared.size())];
        order_after(t, b.stream);
        for (stream_handle u : b.users) order_after(t, u);
        dev.launch(t, 1 + pick(50), {reads(b.ptr, b.size)},
                   "last use before a stream-ordered free");
        alloc.deallocate(b.ptr, t);
      } else {
        alloc.deallocate(b.ptr);
      }
    };
    try {
      for (int i = 0; i < ops_per_worker && !failed; ++i) {
        ++out.ops;
        const std::size_t op = pick(100);
        if (op < 35 || mine.empty()) {
          if (mine.size() >= 8) continue;
          // Own stream mostly; a shared stream sometimes (several threads allocate there).
          const stream_handle s = pick(4) ? own[static_cast<std::size_t>(id)]
                                          : shared[pick(shared.size())];
          const std::size_t size = pick(10) < 8 ? 1 + pick(2 * MiB) : 4 * MiB + pick(12 * MiB);
          void* p = nullptr;
          try {
            p = alloc.allocate(size, s);
          } catch (const out_of_memory&) {
            ++out.ooms;
            continue;
          }
          ++out.allocations;
          dev.launch(s, 1 + pick(100), {writes(p, size)}, "write after allocate");
          mine.push_back({p, size, s, {}});
        } else if (op < 55) {
          live& b = mine[pick(mine.size())];
          const stream_handle t = shared[pick(shared.size())];
          if (t == b.stream) continue;
          order_after(t, b.stream);
          for (stream_handle u : b.users) order_after(t, u);
          dev.launch(t, 1 + pick(200), {reads(b.ptr, b.size)}, "read on a shared stream");
          alloc.record_stream(b.ptr, t);
          b.users.push_back(t);
        } else if (op < 75) {
          const std::size_t k = pick(mine.size());
          live b = mine[k];
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
          free_one(b, pick(3) == 0);
        } else if (op < 82) {
          // Hand a block to another thread, which frees it.
          const std::size_t k = pick(mine.size());
          box.put(mine[k]);
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
          ++out.handed_over;
        } else if (op < 90) {
          live b;
          if (box.take(b)) free_one(b, pick(2) == 0);
        } else if (op < 93) {
          (void)alloc.find_block(mine[pick(mine.size())].ptr);
          (void)alloc.stats();
        } else {
          // Same-stream churn: the fast path.
          const stream_handle s = own[static_cast<std::size_t>(id)];
          try {
            void* p = alloc.allocate(1 + pick(64 * KiB), s);
            dev.launch(s, 1, {writes(p, 512)});
            alloc.deallocate(p);
          } catch (const out_of_memory&) {
            ++out.ooms;
          }
        }
      }
      for (live& b : mine) alloc.deallocate(b.ptr);
    } catch (const std::exception& e) {
      fail("worker " + std::to_string(id) + ": " + e.what());
    }
    std::lock_guard<std::mutex> lk(error_mu);
    total.ops += out.ops;
    total.allocations += out.allocations;
    total.ooms += out.ooms;
    total.handed_over += out.handed_over;
  };

  auto maintenance = [&] {
    std::mt19937_64 rng(99);
    std::uint64_t n = 0;
    try {
      while (running.load() > 0 && !failed) {
        ++n;
        switch (rng() % 8) {
          case 0: alloc.empty_cache(empty_cache_mode::wait); break;
          case 1: alloc.empty_cache(empty_cache_mode::defer); break;
          case 2: alloc.empty_cache(); break;
          case 3: alloc.reclaim(); break;
          case 4: alloc.check_invariants(); break;
          case 5:
            (void)alloc.largest_free_block_bytes();
            (void)alloc.pending_release_bytes();
            break;
          case 6:
            alloc.reset_peak_stats();
            (void)alloc.stats();
            break;
          default: dev.advance(rng() % 400); break;
        }
        std::this_thread::yield();
      }
    } catch (const std::exception& e) {
      fail(std::string("maintenance thread: ") + e.what());
    }
    std::lock_guard<std::mutex> lk(error_mu);
    total.maintenance = n;
  };

  {
    watchdog dog(std::chrono::seconds(300), "thread stress (" + std::string(to_string(backend)) +
                                                ", " + to_string(mode) + ")");
    std::vector<std::thread> threads;
    std::thread keeper(maintenance);
    for (int i = 0; i < k_workers; ++i) {
      threads.emplace_back([&, i] {
        worker(i);
        running.fetch_sub(1);
      });
    }
    for (auto& t : threads) t.join();
    keeper.join();
    // Blocks still in the mailbox are freed here.
    live b;
    while (box.take(b)) alloc.deallocate(b.ptr);
    dev.run_until_idle();
    alloc.empty_cache(empty_cache_mode::wait);
  }
  try {
    alloc.check_invariants();
  } catch (const std::exception& e) {
    fail(e.what());
  }
  const statistics s = alloc.stats();
  if (s.allocated_bytes.current != 0)
    fail("allocated bytes left: " + std::to_string(s.allocated_bytes.current));
  if (s.reserved_bytes.current != 0)
    fail("reserved bytes left: " + std::to_string(s.reserved_bytes.current));
  if (dev.bytes_in_use() != 0) fail("device memory left in use");
  if (dev.fault_count() != 0) fail("simulated fault: " + dev.faults().front().message);
  return total;
}

}  // namespace

TEST_CASE(
    "12 threads on own and shared streams, with empty_cache and reclaim from another thread, stay "
    "consistent, fault-free and deadlock-free",
    "[core][threads][stress]") {
  struct config {
    backend_kind backend;
    empty_cache_mode mode;
  };
  for (config c : {config{backend_kind::cuda_malloc, empty_cache_mode::defer},
                   config{backend_kind::cuda_malloc, empty_cache_mode::wait},
                   config{backend_kind::expandable, empty_cache_mode::wait},
                   config{backend_kind::expandable, empty_cache_mode::defer}}) {
    INFO(to_string(c.backend) << "/" << to_string(c.mode));
    const outcome out = stress(c.backend, c.mode, 3000);
    INFO(out.ops << " operations, " << out.allocations << " allocations, " << out.ooms
                 << " out of memory, " << out.handed_over << " handed to another thread, "
                 << out.maintenance << " maintenance calls");
    CHECK(out.error.empty());
    if (!out.error.empty()) FAIL_CHECK(out.error);
    CHECK(out.ops == static_cast<std::uint64_t>(k_workers) * 3000);
  }
}
