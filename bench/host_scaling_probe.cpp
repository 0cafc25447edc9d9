// host_scaling_probe: how a private, cache-resident compute loop scales with threads on this host.
//
// The reference for scenario 3 (docs/benchmarks.md): each of 1, 2, 4, 8 and 16 threads runs a
// multiply-add chain with stores into its own 4 KiB table for 0.4 s, sharing nothing. If its
// per-thread rate stays flat, the host gives every thread the same speed for this kind of loop,
// and any fall in an allocator's per-thread rate comes from what that loop does not exercise.
// No allocator, no CUDA. Output: total and per-thread million loop iterations per second.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

int main() {
  for (const int threads : {1, 2, 4, 8, 16}) {
    std::atomic<bool> go{false};
    std::atomic<bool> stop{false};
    std::vector<std::uint64_t> iterations(static_cast<std::size_t>(threads) * 16,
                                          0);  // a line each
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        alignas(64) std::uint64_t table[512] = {};
        std::uint64_t x = static_cast<std::uint64_t>(t) + 1;
        std::uint64_t n = 0;
        while (!go.load()) {
        }
        while (!stop.load(std::memory_order_relaxed)) {
          for (int i = 0; i < 1000; ++i) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            table[(x >> 40) & 511] += x;
          }
          n += 1000;
        }
        iterations[static_cast<std::size_t>(t) * 16] = n + (table[x & 511] & 1);
      });
    }
    const auto t0 = std::chrono::steady_clock::now();
    go = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    stop = true;
    for (auto& th : pool) th.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double total = 0;
    for (int t = 0; t < threads; ++t)
      total += static_cast<double>(iterations[static_cast<std::size_t>(t) * 16]);
    std::printf("threads %2d: total %.0f M iterations/s, per thread %.0f M iterations/s\n", threads,
                total / seconds / 1e6, total / seconds / 1e6 / threads);
  }
  return 0;
}
