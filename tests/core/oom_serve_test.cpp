// Out of memory only when nothing could serve the request, on the simulated device (both
// backends; pause and resume exist only on the expandable backend): memory pending another
// stream's work, memory made free by the out-of-memory path itself, memory that moved while the
// path waited, many threads with empty_cache beside them, a tag's resume beside other tags'
// cache, and a peak of reserved bytes that never passes a cap the backend enforces while the
// release worker gives memory back.
#include "support/sim_fixture.hpp"

#include <streamsafe/backends/forwarding_backend.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/sleep.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;
using namespace streamsafe::test;
using namespace std::chrono_literals;

namespace {

const char* mode_name(empty_cache_mode m) { return m == empty_cache_mode::wait ? "wait" : "defer"; }

// The host waits the simulated device has seen: event and device synchronisations, bounded or not.
std::uint64_t host_waits_of(const sim::counters& c) {
  return c.event_syncs + c.bounded_event_syncs + c.device_syncs;
}
std::uint64_t host_waits(const sim::simulated_device& dev) { return host_waits_of(dev.counters()); }

// A backend that runs `hook` once, on the thread of the first call of the kind asked for
// (a bounded host wait, an unbounded one, or a segment free / chunk unmap), after the call
// itself; refuses
// memory past `cap_bytes` of the device's bytes in use (0 = none), as the PyTorch extension's
// memory-fraction backend does.
class hooked_device final : public forwarding_backend {
 public:
  enum class on { bounded_wait, wait, release };
  explicit hooked_device(sim::simulated_device& dev) : forwarding_backend(dev), dev_(dev) {}

  void arm(on when, std::function<void()> hook) {
    std::lock_guard<std::mutex> lk(mu_);
    when_ = when;
    hook_ = std::move(hook);
  }
  std::size_t cap_bytes = 0;
  std::atomic<std::size_t> most_in_use{0};

  void synchronize_event(event_handle event) override {
    forwarding_backend::synchronize_event(event);
    fire(on::wait);
  }
  bool synchronize_event_for(event_handle event, std::uint64_t timeout_us) override {
    const bool done = forwarding_backend::synchronize_event_for(event, timeout_us);
    fire(on::bounded_wait);
    return done;
  }
  void free_segment(void* ptr, std::size_t size_bytes) override {
    forwarding_backend::free_segment(ptr, size_bytes);
    fire(on::release);
  }
  void unmap(void* addr, std::size_t size_bytes) override {
    forwarding_backend::unmap(addr, size_bytes);
    fire(on::release);
  }
  void* allocate_segment(std::size_t size_bytes) override {
    if (!fits(size_bytes)) return nullptr;
    void* p = forwarding_backend::allocate_segment(size_bytes);
    note();
    return p;
  }
  bool map(void* addr, std::size_t size_bytes) override {
    if (!fits(size_bytes)) return false;
    const bool ok = forwarding_backend::map(addr, size_bytes);
    note();
    return ok;
  }

 private:
  bool fits(std::size_t size_bytes) const {
    return cap_bytes == 0 || dev_.bytes_in_use() + size_bytes <= cap_bytes;
  }
  void note() {
    const std::size_t now = dev_.bytes_in_use();
    std::size_t seen = most_in_use.load();
    while (now > seen && !most_in_use.compare_exchange_weak(seen, now)) {
    }
  }
  void fire(on what) {
    std::function<void()> hook;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!hook_ || when_ != what) return;
      hook = std::move(hook_);
      hook_ = nullptr;
    }
    hook();
  }
  sim::simulated_device& dev_;
  std::mutex mu_;
  on when_ = on::release;
  std::function<void()> hook_;
};

// Runs f on a thread of its own and waits for it at most `bound`: the hook of a backend call must
// not hang the test when the allocator (rightly) makes that thread wait for the call.
std::future<void> run_beside(std::function<void()> f, std::chrono::milliseconds bound) {
  std::future<void> done = std::async(std::launch::async, std::move(f));
  done.wait_for(bound);
  return done;
}

// Three 64 MiB blocks of stream y, read by a long kernel of y, freed: y's cache, fenced.
void cache_behind_long_reads(caching_allocator& alloc, sim::simulated_device& dev,
                             stream_handle y) {
  std::vector<void*> ys;
  for (int i = 0; i < 3; ++i) ys.push_back(alloc.allocate(64 * MiB, y));
  for (void* p : ys) dev.launch(y, 100000, {reads(p, 64 * MiB)}, "long read on y");
  for (void* p : ys) alloc.deallocate(p);
}

// Four 64 MiB blocks of stream a, written on a, then read on t for 2 ms in all (t waits for the
// writes through ev), each recorded on t: once freed, their memory is pending t's reads.
std::vector<void*> blocks_read_on(caching_allocator& alloc, sim::simulated_device& dev,
                                  stream_handle a, stream_handle t, event_handle ev) {
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(alloc.allocate(64 * MiB, a));
  for (void* p : blocks) dev.launch(a, 10, {writes(p, 64 * MiB)}, "produce");
  dev.record_event(ev, a);
  dev.stream_wait_event(t, ev);
  for (void* p : blocks) dev.launch(t, 500, {reads(p, 64 * MiB)}, "read (2 ms in all)");
  for (void* p : blocks) alloc.record_stream(p, t);
  return blocks;
}

// q (64 MiB of stream b, served under the 256 MiB limit) written and freed: no fault, reserved's
// peak within the limit, the allocator consistent.
void use_and_check(caching_allocator& alloc, sim::simulated_device& dev, void* q, stream_handle b) {
  dev.launch(b, 10, {writes(q, 64 * MiB)}, "stream b writes");
  alloc.deallocate(q);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(256 * MiB));
  alloc.check_invariants();
}

}  // namespace

TEST_CASE(
    "Memory pending another stream's work serves another stream's request behind a stream wait, "
    "without a host wait, in both empty_cache modes",
    "[core][oom-serve][pending]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  INFO(to_string(backend) << ", empty_cache " << mode_name(mode));
  sim::simulated_device dev(sim_config(8 * GiB));
  options o = make_options(backend, fence_scope::all_streams, mode);
  o.memory_limit_bytes = 256 * MiB;
  caching_allocator alloc(dev, o);
  const stream_handle a = dev.create_stream();
  const stream_handle t = dev.create_stream();
  const stream_handle b = dev.create_stream();
  const event_handle ev = dev.create_event();
  for (void* p : blocks_read_on(alloc, dev, a, t, ev)) alloc.deallocate(p);
  const std::uint64_t waits_before = host_waits(dev);
  void* q = nullptr;
  try {
    q = alloc.allocate(64 * MiB, b);
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  CHECK(host_waits(dev) == waits_before);
  use_and_check(alloc, dev, q, b);
  dev.destroy_event(ev);
}

TEST_CASE(
    "Memory of a destroyed stream's pool pending another stream's work serves a request once that "
    "work ends: the destroyed stream can wait on nothing, so the host waits, bounded",
    "[core][oom-serve][pending][destroyed-streams]") {
  // Found by the fuzz harness (cuda_malloc, reuse_fence:all_streams): five small segments of
  // streams destroyed with a block each still pending, the limit reached, a small request of a
  // live stream thrown out_of_memory with 10 MiB of segments holding no live block.
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  const reuse_fence_scope reuse = GENERATE(reuse_fence_scope::allocation_stream,
                                           reuse_fence_scope::all_streams);
  INFO(to_string(backend) << ", empty_cache " << mode_name(mode) << ", reuse_fence "
                          << to_string(reuse));
  sim::simulated_device dev(sim_config(8 * GiB));
  options o = make_options(backend, fence_scope::all_streams, mode);
  o.reuse_fence = reuse;
  o.memory_limit_bytes = 256 * MiB;
  caching_allocator alloc(dev, o);
  const stream_handle d = dev.create_stream();
  const stream_handle t = dev.create_stream();
  const stream_handle b = dev.create_stream();
  const event_handle ev = dev.create_event();
  const std::vector<void*> blocks = blocks_read_on(alloc, dev, d, t, ev);
  alloc.notify_stream_destroyed(d);
  dev.destroy_stream(d);
  for (void* p : blocks) alloc.deallocate(p);
  void* q = nullptr;
  try {
    q = alloc.allocate(64 * MiB, b);
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  use_and_check(alloc, dev, q, b);
  dev.destroy_event(ev);
}

TEST_CASE(
    "An exported block, freed and released by its consumer whose read is still running, serves a "
    "request at the limit behind a stream wait on the consumer's release event",
    "[core][oom-serve][ipc]") {
  // Found by strict fuzzing (expandable, defer, 20 MiB chunks): the free stayed held out of every
  // pool until a poll saw the consumer's event complete, and the request at the limit failed.
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  const bool other_stream = GENERATE(false, true);
  const bool free_first = GENERATE(false, true);
  INFO(to_string(backend) << ", empty_cache " << mode_name(mode)
                          << (other_stream ? ", requested on another stream" : ", same stream")
                          << (free_first ? ", freed before the release arrives" : ""));
  sim::simulated_device dev(sim_config(8 * GiB));
  options o = make_options(backend, fence_scope::all_streams, mode);
  o.memory_limit_bytes = 256 * MiB;
  caching_allocator producer(dev, o);
  caching_allocator consumer(dev, make_options(backend));
  const stream_handle ps = dev.create_stream();
  const stream_handle cs = dev.create_stream();
  const stream_handle b = other_stream ? dev.create_stream() : ps;
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(producer.allocate(64 * MiB, ps));
  for (void* p : blocks) dev.launch(ps, 10, {writes(p, 64 * MiB, 7)}, "produce");
  dev.run_until_idle();
  const imported_block imp = consumer.import_block(producer.export_block(blocks[0]));
  dev.launch(cs, 2000, {reads(imp.ptr, 64 * MiB)}, "the consumer's long read");
  const ipc_release r = consumer.release_import(imp.ptr, cs);
  if (!free_first) producer.notify_import_released(r);
  producer.deallocate(blocks[0]);
  if (free_first) producer.notify_import_released(r);
  REQUIRE(producer.ipc_status().held_frees == 1);
  const std::uint64_t waits_before = host_waits(dev);
  void* q = nullptr;
  try {
    q = producer.allocate(64 * MiB, b);
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  CHECK(host_waits(dev) == waits_before);
  CHECK(producer.ipc_status().held_frees == 0);
  CHECK(producer.ipc_status().exports == 0);
  use_and_check(producer, dev, q, b);  // a write not ordered after the read faults
  for (std::size_t i = 1; i < blocks.size(); ++i) producer.deallocate(blocks[i]);
  consumer.reclaim();
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
}

TEST_CASE(
    "A block of another stream freed while a third stream reads it serves the next request of "
    "its size under the limit, reused behind stream waits rather than given back or grown beside",
    "[core][oom-serve][pending]") {
  enum class variant { read_running, read_done, freed_on_reader };
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  const empty_cache_mode mode = GENERATE(empty_cache_mode::wait, empty_cache_mode::defer);
  const variant v = GENERATE(variant::read_running, variant::read_done, variant::freed_on_reader);
  INFO(to_string(backend) << ", empty_cache " << mode_name(mode) << ", variant "
                          << static_cast<int>(v));
  sim::simulated_device dev(sim_config(8 * GiB));
  options o = make_options(backend, fence_scope::all_streams, mode);
  o.memory_limit_bytes = 1 * GiB;
  caching_allocator alloc(dev, o);
  const stream_handle s = dev.create_stream();
  const stream_handle producer = dev.create_stream();
  const stream_handle r = dev.create_stream();
  const event_handle ev = dev.create_event();
  void* live = alloc.allocate(350 * MiB, s);
  void* big = alloc.allocate(600 * MiB, producer);
  dev.launch(s, 10, {writes(live, 350 * MiB)}, "live");
  dev.launch(producer, 10, {writes(big, 600 * MiB)}, "produce");
  dev.record_event(ev, producer);
  dev.stream_wait_event(r, ev);
  dev.launch(r, 5000, {reads(big, 600 * MiB)}, "held stream reads");
  if (v == variant::freed_on_reader) {
    alloc.deallocate(big, r);
  } else {
    alloc.record_stream(big, r);
    alloc.deallocate(big);
  }
  if (v == variant::read_done) dev.advance(10000);
  const sim::counters before = dev.counters();
  void* again = nullptr;
  try {
    again = alloc.allocate(600 * MiB, s);
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  const sim::counters after = dev.counters();
  CHECK(host_waits(dev) == host_waits_of(before));
  CHECK(after.segment_allocs == before.segment_allocs);  // the 600 MiB came back, nothing new
  // Expandable chunks idle at the request (the read done) go back to the driver before a growth
  // past the peak and are mapped anew (the corpus-tuned policy, growth_policy.cpp): only memory
  // still pending must be reused in place.
  if (backend == backend_kind::cuda_malloc || v != variant::read_done)
    CHECK(after.bytes_mapped == before.bytes_mapped);
  dev.launch(s, 10, {writes(again, 600 * MiB)}, "reuse");
  alloc.deallocate(again);
  alloc.deallocate(live);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(1 * GiB));
  alloc.check_invariants();
  dev.destroy_event(ev);
}

TEST_CASE(
    "Memory that moved into the cache while the allocation waited on fences serves it: the serve "
    "path walks again after each wait",
    "[core][oom-serve][threads]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO(to_string(backend));
  sim::simulated_device dev(sim_config(8 * GiB));
  hooked_device hooked(dev);
  options o = make_options(backend, fence_scope::all_streams, empty_cache_mode::defer);
  o.release_worker = release_worker_mode::off;
  o.memory_limit_bytes = 256 * MiB;
  caching_allocator alloc(hooked, o);
  const stream_handle x = dev.create_stream();
  const stream_handle y = dev.create_stream();
  // Thread Y's cache: three 64 MiB blocks freed in stream order behind a long kernel of y.
  cache_behind_long_reads(alloc, dev, y);
  // While X waits on the host for the fences of what its out-of-memory path queued, Y takes that
  // memory back and frees it into its cache again.
  std::future<void> y_done;
  hooked.arm(hooked_device::on::bounded_wait, [&] {
    y_done = run_beside(
        [&] {
          std::vector<void*> again;
          for (int i = 0; i < 3; ++i) again.push_back(alloc.allocate(64 * MiB, y));
          for (void* p : again) alloc.deallocate(p);
        },
        2000ms);
  });
  void* q = nullptr;
  try {
    q = alloc.allocate(128 * MiB, x);
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  if (y_done.valid()) y_done.get();
  dev.launch(x, 10, {writes(q, 128 * MiB)}, "x writes");
  alloc.deallocate(q);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(256 * MiB));
  alloc.check_invariants();
}

TEST_CASE(
    "cuda_malloc, defer: gradients queued behind the optimizer stream's fences serve the next "
    "buffer while another stream keeps the device busy (cudaFree waits for the whole device)",
    "[core][oom-serve][pending]") {
  const bool worker = GENERATE(false, true);
  INFO("release worker " << (worker ? "on" : "off"));
  sim::device_config cfg = sim_config(8 * GiB);
  cfg.free_segment_synchronizes = true;  // as cudaFree
  sim::simulated_device dev(cfg);
  hooked_device hooked(dev);
  options o = make_options(backend_kind::cuda_malloc, fence_scope::all_streams,
                           empty_cache_mode::defer);
  o.release_worker = worker ? release_worker_mode::on : release_worker_mode::off;
  o.memory_limit_bytes = 512 * MiB;
  caching_allocator alloc(hooked, o);
  const stream_handle compute = dev.create_stream();
  const stream_handle side = dev.create_stream();
  const stream_handle opt = dev.create_stream();
  const stream_handle other = dev.create_stream();  // a second thread's stream
  const event_handle ev = dev.create_event();
  void* params = alloc.allocate(128 * MiB, compute);
  std::vector<void*> grads;
  for (int i = 0; i < 4; ++i) grads.push_back(alloc.allocate(64 * MiB, side));
  for (void* g : grads) dev.launch(side, 10, {writes(g, 64 * MiB)}, "gradient");
  dev.record_event(ev, side);
  dev.stream_wait_event(opt, ev);
  for (void* g : grads) {
    dev.launch(opt, 1000, {reads(g, 64 * MiB), writes(params, 128 * MiB)}, "optimizer step");
    alloc.record_stream(g, opt);
    alloc.deallocate(g);
  }
  alloc.empty_cache();  // the optimizer still reads them: queued behind its fence
  // The second thread keeps its stream busy: 300 ms of work more while the allocation below
  // waits on the host for the fences (none covers it, and cudaFree would wait for it).
  void* t_buf = alloc.allocate(MiB, other);
  dev.launch(other, 1000, {writes(t_buf, MiB)}, "another thread's work");
  hooked.arm(hooked_device::on::bounded_wait,
             [&] { dev.launch(other, 300000, {writes(t_buf, MiB)}, "another thread's work"); });
  void* buffer = nullptr;
  try {
    buffer = alloc.allocate(256 * MiB, compute);
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  dev.launch(compute, 10, {writes(buffer, 256 * MiB)}, "the buffer");
  alloc.deallocate(buffer);
  alloc.deallocate(t_buf);
  alloc.deallocate(params);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(512 * MiB));
  alloc.check_invariants();
  dev.destroy_event(ev);
}

TEST_CASE(
    "Memory that another thread's empty_cache:wait holds out of the pools while it waits on its "
    "fence serves a request once that wait ends",
    "[core][oom-serve][threads]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO(to_string(backend));
  sim::simulated_device dev(sim_config(8 * GiB));
  hooked_device hooked(dev);
  options o = make_options(backend, fence_scope::all_streams, empty_cache_mode::wait);
  o.release_worker = release_worker_mode::off;
  o.memory_limit_bytes = 256 * MiB;
  caching_allocator alloc(hooked, o);
  const stream_handle x = dev.create_stream();
  const stream_handle y = dev.create_stream();
  cache_behind_long_reads(alloc, dev, y);
  // Y's empty_cache() waits on the fence of its 192 MiB; meanwhile X asks for 128 MiB, which
  // only that memory can make room for once it is back with the driver.
  std::future<void> x_done;
  void* q = nullptr;
  std::string failure;
  hooked.arm(hooked_device::on::wait, [&] {
    x_done = run_beside(
        [&] {
          try {
            q = alloc.allocate(128 * MiB, x);
          } catch (const out_of_memory& e) {
            failure = e.what();
          }
        },
        500ms);
  });
  alloc.empty_cache();
  REQUIRE(x_done.valid());
  x_done.get();
  INFO(failure);
  REQUIRE(q != nullptr);
  dev.launch(x, 10, {writes(q, 128 * MiB)}, "x writes");
  alloc.deallocate(q);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(256 * MiB));
  alloc.check_invariants();
}

TEST_CASE(
    "Six threads allocating, recording streams and freeing beside empty_cache and statistics "
    "readers never run out of memory under a limit the live blocks fit",
    "[core][oom-serve][threads]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO(to_string(backend));
  constexpr int k_threads = 6;
  constexpr int k_steps = 150;
  constexpr std::size_t k_limit = 1 * GiB;
  sim::simulated_device dev(sim_config(8 * GiB));
  options o = make_options(backend, fence_scope::all_streams, empty_cache_mode::defer);
  o.release_worker = release_worker_mode::on;
  o.memory_limit_bytes = k_limit;
  caching_allocator alloc(dev, o);
  std::vector<stream_handle> streams;
  std::vector<event_handle> events;
  for (int i = 0; i < k_threads; ++i) {
    streams.push_back(dev.create_stream());
    events.push_back(dev.create_event());
  }
  std::atomic<int> ooms{0};
  std::atomic<bool> stop{false};
  std::mutex first_mu;
  std::string first_message;
  std::vector<std::thread> workers;
  for (int i = 0; i < k_threads; ++i) {
    workers.emplace_back([&, i] {
      std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(i));
      const stream_handle own = streams[static_cast<std::size_t>(i)];
      const stream_handle next = streams[static_cast<std::size_t>((i + 1) % k_threads)];
      for (int step = 0; step < k_steps; ++step) {
        const std::size_t bytes = (1 + rng() % 96) * MiB;  // at most 6 x 96 = 576 MiB live
        void* p = nullptr;
        try {
          p = alloc.allocate(bytes, own);
        } catch (const out_of_memory& e) {
          if (ooms.fetch_add(1) == 0) {
            std::lock_guard<std::mutex> lk(first_mu);
            first_message = e.what();
          }
          continue;
        }
        dev.launch(own, 20, {writes(p, bytes)}, "write");
        if (rng() % 2 == 0) {
          dev.record_event(events[static_cast<std::size_t>(i)], own);
          dev.stream_wait_event(next, events[static_cast<std::size_t>(i)]);
          dev.launch(next, 50 + rng() % 200, {reads(p, bytes)}, "read on the next stream");
          alloc.record_stream(p, next);
        }
        alloc.deallocate(p);
        dev.advance(10);
      }
    });
  }
  std::thread emptier([&] {
    while (!stop.load()) {
      alloc.empty_cache();
      std::this_thread::yield();
    }
  });
  std::thread reader([&] {
    while (!stop.load()) {
      const statistics s = alloc.stats();
      CHECK(s.reserved_bytes.current <= static_cast<std::int64_t>(k_limit));
      (void)alloc.snapshot();
      std::this_thread::yield();
    }
  });
  for (auto& w : workers) w.join();
  stop = true;
  emptier.join();
  reader.join();
  INFO("first out-of-memory message: " << first_message);
  CHECK(ooms.load() == 0);
  dev.run_until_idle();
  CHECK(alloc.wait_for_release_worker_idle(5s));
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(k_limit));
  alloc.check_invariants();
  for (event_handle e : events) dev.destroy_event(e);
}

TEST_CASE(
    "resume under a limit takes back the untagged cache and other tags' cache (expandable: the "
    "only backend that pauses)",
    "[core][oom-serve][sleep]") {
  const bool other_tag = GENERATE(false, true);
  INFO((other_tag ? "another tag's cache" : "the untagged cache"));
  sim::simulated_device dev(sim_config(8 * GiB));
  options o = make_options(backend_kind::expandable, fence_scope::all_streams,
                           empty_cache_mode::wait);
  o.release_worker = release_worker_mode::off;
  o.memory_limit_bytes = 192 * MiB;
  caching_allocator alloc(dev, o);
  const stream_handle s = dev.create_stream();
  void* weights = nullptr;
  {
    tag_scope scope("train");
    weights = alloc.allocate(96 * MiB, s);
  }
  dev.launch(s, 10, {writes(weights, 96 * MiB, 7)}, "weights");
  REQUIRE(alloc.pause("train", pause_mode::offload).phase == tag_phase::paused);
  {
    // The generation engine's memory, freed and cached when the trainer wakes.
    std::optional<tag_scope> scope;
    if (other_tag) scope.emplace("generate");
    void* p = alloc.allocate(160 * MiB, s);
    dev.launch(s, 10, {writes(p, 160 * MiB)}, "generate");
    alloc.deallocate(p);
  }
  pause_status back;
  try {
    back = alloc.resume("train");
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  CHECK(back.phase == tag_phase::active);
  dev.launch(s, 1, {reads(weights, 96 * MiB)}, "forward");
  alloc.deallocate(weights);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(192 * MiB));
  alloc.check_invariants();
}

TEST_CASE(
    "The peak of reserved bytes never passes a cap the backend enforces while the release worker "
    "gives memory back beside a growth",
    "[core][oom-serve][worker]") {
  const backend_kind backend = GENERATE(backend_kind::cuda_malloc, backend_kind::expandable);
  INFO(to_string(backend));
  constexpr std::size_t k_block = 100 * MiB;
  constexpr std::size_t k_cap = 4 * k_block;
  sim::simulated_device dev(sim_config(8 * GiB));
  hooked_device hooked(dev);
  options o = make_options(backend, fence_scope::all_streams, empty_cache_mode::defer);
  o.release_worker = release_worker_mode::on;
  caching_allocator alloc(hooked, o);
  const stream_handle s = dev.create_stream();
  const stream_handle other = dev.create_stream();
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(alloc.allocate(k_block, s));
  for (void* p : blocks) dev.launch(s, 10, {writes(p, k_block)}, "write");
  dev.run_until_idle();
  for (void* p : blocks) alloc.deallocate(p);
  hooked.cap_bytes = k_cap;
  alloc.reset_peak_stats();
  // After the worker's first driver call gave memory back (the device holds less than the cap),
  // another stream grows into it while the worker's release is still underway.
  std::future<void> grown;
  std::promise<void*> served;
  std::future<void*> served_f = served.get_future();
  hooked.arm(hooked_device::on::release, [&] {
    grown = run_beside(
        [&] {
          try {
            served.set_value(alloc.allocate(k_block, other));
          } catch (...) {
            served.set_exception(std::current_exception());
          }
        },
        300ms);
  });
  alloc.empty_cache();
  REQUIRE(alloc.wait_for_release_worker_idle(5s));
  void* q = nullptr;
  try {
    q = served_f.get();
  } catch (const out_of_memory& e) {
    FAIL("out of memory: " << e.what());
  }
  if (grown.valid()) grown.get();
  CHECK(hooked.most_in_use.load() <= k_cap);
  CHECK(alloc.stats().reserved_bytes.peak <= static_cast<std::int64_t>(k_cap));
  alloc.deallocate(q);
  dev.run_until_idle();
  CHECK(dev.fault_count() == 0);
  alloc.check_invariants();
}
