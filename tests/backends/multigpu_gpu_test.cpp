// Several GPUs (cases K1, K7 and K8 on real hardware; peer access to expandable segments), tag
// [gpu][multigpu]: every test skips, with a message, where fewer than two GPUs are present.
// Every wait is bounded: kernels that wait for the host or for the other device spin on the
// GPU's global timer for at most a few seconds and report whether they timed out, and the K8
// driver thread is joined with a time limit, so that a hang becomes a failure.
#include "support/gpu.hpp"

#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/errors.hpp>
#include <streamsafe/frontends/allocator.hpp>
#include <streamsafe/kernels/collective.hpp>
#include <streamsafe/kernels/optimizers.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <future>
#include <string>
#include <thread>
#include <vector>

using namespace streamsafe;

namespace {

using namespace std::chrono_literals;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr double k_wait_limit_ms = 15000;  // how long a waiting kernel spins before it gives up

stream_handle h(cudaStream_t s) { return reinterpret_cast<stream_handle>(s); }

// Pinned host memory that the host and every device read and write: four exchange flags and
// four "arrived" results, zeroed.
class shared_flags {
 public:
  shared_flags() {
    REQUIRE(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(slots),
                          cudaHostAllocPortable | cudaHostAllocMapped) == cudaSuccess);
    std::memset(host_, 0, sizeof(slots));
    REQUIRE(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0) == cudaSuccess);
  }
  ~shared_flags() { cudaFreeHost(host_); }
  shared_flags(const shared_flags&) = delete;
  shared_flags& operator=(const shared_flags&) = delete;

  unsigned* flags() const { return device_->flags; }
  int* arrived(int slot) const { return &device_->arrived[slot]; }
  // The host stands in for a kernel: sets flag `slot` (opens a kernel waiting on it).
  void set(int slot, unsigned value) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    static_cast<volatile unsigned*>(host_->flags)[slot] = value;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  int arrived_value(int slot) const { return static_cast<volatile int*>(host_->arrived)[slot]; }

 private:
  struct slots {
    unsigned flags[4];
    int arrived[4];
  };
  slots* host_ = nullptr;
  slots* device_ = nullptr;
};

// Sets a flag when it goes out of scope, so that a test that fails half-way never leaves a
// kernel waiting (declare it after the allocator: it runs first).
struct open_on_exit {
  shared_flags& flags;
  int slot;
  ~open_on_exit() { flags.set(slot, 1); }
};

// A non-blocking stream on one device, destroyed after its work finished.
struct device_stream {
  int device;
  cudaStream_t s = nullptr;
  explicit device_stream(int d) : device(d) {
    REQUIRE(cudaSetDevice(d) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~device_stream() {
    cudaSetDevice(device);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
};

// Loads every kernel the tests launch on `device` (lazy module loading would otherwise load
// them, and wait for the device, in the middle of a test).
void warm_up(int device, shared_flags& f) {
  REQUIRE(cudaSetDevice(device) == cudaSuccess);
  void* scratch = nullptr;
  REQUIRE(cudaMalloc(&scratch, 4096) == cudaSuccess);
  auto* sum = static_cast<unsigned long long*>(scratch);
  REQUIRE(kernels::launch_spin(nullptr, 0) == cudaSuccess);
  REQUIRE(kernels::launch_fill(static_cast<char*>(scratch) + 512, 512, 1, nullptr) == cudaSuccess);
  REQUIRE(kernels::launch_read_sum(static_cast<char*>(scratch) + 512, 512, sum, nullptr) ==
          cudaSuccess);
  // Generation 0: every flag already holds it, so the exchange returns at once.
  REQUIRE(kernels::launch_exchange_flags(f.flags(), 2, 3, 0, 0, f.arrived(3), nullptr) ==
          cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cudaFree(scratch) == cudaSuccess);
}

options with(backend_kind backend, empty_cache_mode mode) {
  options o;
  o.backend = backend;
  o.empty_cache = mode;
  return o;
}

bool default_stream_idle(int device) {
  REQUIRE(cudaSetDevice(device) == cudaSuccess);
  const cudaError_t e = cudaStreamQuery(nullptr);
  (void)cudaGetLastError();  // "not ready" is an answer
  return e == cudaSuccess;
}

}  // namespace

TEST_CASE(
    "K1 on two GPUs: empty_cache with device 0 current waits on device 1's default stream before "
    "releasing "
    "device 1's segment",
    "[gpu][multigpu][backends][cases][K1]") {
  STREAMSAFE_REQUIRE_GPUS(2);
  shared_flags f;
  warm_up(1, f);
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO("backend " << to_string(backend));
    cuda::allocator alloc(with(backend, empty_cache_mode::wait));
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    void* p = alloc.allocate(64 * MiB, 1, nullptr);  // device 1's legacy default stream
    REQUIRE(kernels::launch_spin(nullptr, 300) == cudaSuccess);
    REQUIRE(kernels::launch_fill(p, 64 * MiB, 0x5A, nullptr) ==
            cudaSuccess);  // writes p behind the spin
    alloc.deallocate(p);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    const std::size_t released = alloc.empty_cache();
    int current = -1;
    REQUIRE(cudaGetDevice(&current) == cudaSuccess);
    CHECK(current == 0);
    CHECK(default_stream_idle(1));  // released only after device 1's write finished
    CHECK(released >= 64 * MiB);
    const statistics st = alloc.stats(1);
    CHECK(st.fence_waits >= 1);  // the host waited on device 1's fence events
    CHECK(st.num_sync_all_streams == 0);
    CHECK(alloc.find_device_allocator(0) == nullptr);  // nothing happened on device 0
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);  // no illegal memory access on device 1
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
  }
}

TEST_CASE(
    "K1 on two GPUs: with empty_cache:defer and device 0 current, device 1's segment waits in the "
    "queue "
    "until device 1's default stream has passed it",
    "[gpu][multigpu][backends][cases][K1]") {
  STREAMSAFE_REQUIRE_GPUS(2);
  {
    shared_flags warm;
    warm_up(1, warm);
  }
  constexpr unsigned generation = 1;
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO("backend " << to_string(backend));
    shared_flags f;  // fresh flags: the hold below waits until the host sets flag 1
    options o = with(backend, empty_cache_mode::defer);
    o.release_worker =
        release_worker_mode::off;  // reclaim on this thread gives it back (no worker)
    cuda::allocator alloc(o);
    open_on_exit opener{f, 1};
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    void* p = alloc.allocate(64 * MiB, 1, nullptr);
    // A hold: device 1's default stream waits until the host sets flag 1.
    REQUIRE(kernels::launch_exchange_flags(f.flags(), 0, 1, generation, k_wait_limit_ms,
                                           f.arrived(0), nullptr) == cudaSuccess);
    REQUIRE(kernels::launch_fill(p, 64 * MiB, 0x5A, nullptr) == cudaSuccess);
    alloc.deallocate(p);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    CHECK(alloc.empty_cache() == 0);
    CHECK(alloc.device_allocator(1).pending_release_bytes() >= 64 * MiB);
    CHECK(alloc.stats(1).releases_deferred == 1);
    CHECK(alloc.find_device_allocator(0) == nullptr);
    CHECK(alloc.reclaim() == 0);  // still held
    CHECK_FALSE(default_stream_idle(1));
    f.set(1, generation);  // open the hold
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
    CHECK(f.arrived_value(0) == 1);  // the hold was opened by the host, not by its time limit
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    CHECK(alloc.reclaim() >= 64 * MiB);
    CHECK(alloc.device_allocator(1).pending_release_bytes() == 0);
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
  }
}

TEST_CASE(
    "On two GPUs, record_stream and frees of a device 1 block run on device 1 while device 0 is "
    "current, "
    "and its reuse is ordered after the recorded use (K7)",
    "[gpu][multigpu][backends][cases][K7]") {
  STREAMSAFE_REQUIRE_GPUS(2);
  shared_flags f;
  warm_up(1, f);
  device_stream s1(1), t1(1);
  {
    cuda::allocator alloc;
    constexpr std::size_t bytes = 32 *
                                  MiB;  // a whole segment: a reuse on s1 takes exactly this block
    void* p = alloc.allocate(bytes, 1, s1.s);
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    REQUIRE(kernels::launch_fill(p, bytes, 0x21, s1.s) == cudaSuccess);
    cudaEvent_t e = nullptr;
    REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaEventRecord(e, s1.s) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(t1.s, e, 0) == cudaSuccess);
    REQUIRE(kernels::launch_spin(t1.s, 200) == cudaSuccess);
    REQUIRE(kernels::launch_fill(p, bytes, 0x42, t1.s) == cudaSuccess);  // a late use on t1
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    alloc.record_stream(p, t1.s);
    alloc.deallocate(p);  // device 0 current: the event goes on t1, on device 1
    void* q = alloc.allocate(bytes, 1, s1.s);  // s1 may take p only behind a wait on t1
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    REQUIRE(kernels::launch_fill(q, bytes, 0x63, s1.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s1.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(t1.s) == cudaSuccess);
    unsigned char first = 0, last = 0;
    REQUIRE(cudaMemcpy(&first, q, 1, cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(&last, static_cast<char*>(q) + bytes - 1, 1, cudaMemcpyDeviceToHost) ==
            cudaSuccess);
    INFO("the new block " << (q == p ? "reuses" : "differs from") << " the freed one");
    CHECK(first == 0x63);  // s1's write landed after t1's
    CHECK(last == 0x63);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    alloc.deallocate(q, s1.s);  // stream-ordered free, routed too
    CHECK(alloc.stats(1).allocated_bytes.current == 0);
    CHECK(alloc.find_device_allocator(0) == nullptr);
    int current = -1;
    REQUIRE(cudaGetDevice(&current) == cudaSuccess);
    CHECK(current == 0);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaEventDestroy(e);
  }
}

TEST_CASE(
    "On two GPUs, a kernel on device 1 reads and writes blocks of device 0's expandable segment, "
    "including "
    "chunks mapped after the first",
    "[gpu][multigpu][backends][expandable]") {
  STREAMSAFE_REQUIRE_GPUS(2);
  int can_access = 0;
  REQUIRE(cudaDeviceCanAccessPeer(&can_access, 1, 0) == cudaSuccess);
  if (can_access == 0) {
    WARN("skipped: device 1 cannot access device 0's memory (no peer access between them)");
    return;
  }
  shared_flags f;
  warm_up(1, f);
  device_stream s0(0), s1(1);
  cuda::expandable_backend backend(0);
  const std::vector<int>& peers = backend.peer_devices();
  CHECK(std::find(peers.begin(), peers.end(), 1) != peers.end());
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  const cudaError_t enabled = cudaDeviceEnablePeerAccess(0, 0);
  (void)cudaGetLastError();
  CHECK((enabled == cudaSuccess || enabled == cudaErrorPeerAccessAlreadyEnabled));
  unsigned long long* sum = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&sum), sizeof(*sum)) == cudaSuccess);
  {
    options o;
    o.backend = backend_kind::expandable;
    caching_allocator alloc(backend, o);
    struct piece {
      std::size_t bytes;
      unsigned char value;
      void* p;
    };
    std::vector<piece> pieces{{8 * MiB, 0x11, nullptr}, {48 * MiB, 0x22, nullptr}};
    for (auto& x : pieces) x.p = alloc.allocate(x.bytes, h(s0.s));  // the second maps later chunks
    const std::size_t chunks_before = backend.mapped_chunk_count();
    CHECK(chunks_before >= 3);
    auto device1_round = [&](const std::vector<piece>& on) {
      REQUIRE(cudaSetDevice(1) == cudaSuccess);
      REQUIRE(cudaMemsetAsync(sum, 0, sizeof(*sum), s1.s) == cudaSuccess);
      unsigned long long expected = 0;
      for (const auto& x : on) {
        REQUIRE(kernels::launch_fill(x.p, x.bytes, x.value, s1.s) == cudaSuccess);
        REQUIRE(kernels::launch_read_sum(x.p, x.bytes, sum, s1.s) == cudaSuccess);
        expected += static_cast<unsigned long long>(x.bytes) * x.value;
      }
      REQUIRE(cudaStreamSynchronize(s1.s) == cudaSuccess);  // an illegal address would show here
      unsigned long long got = 0;
      REQUIRE(cudaMemcpy(&got, sum, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(got == expected);
      REQUIRE(cudaSetDevice(0) == cudaSuccess);
      for (const auto& x : on) {  // device 0 sees what device 1 wrote
        unsigned char first = 0, last = 0;
        REQUIRE(cudaMemcpy(&first, x.p, 1, cudaMemcpyDeviceToHost) == cudaSuccess);
        REQUIRE(cudaMemcpy(&last, static_cast<char*>(x.p) + x.bytes - 1, 1,
                           cudaMemcpyDeviceToHost) == cudaSuccess);
        CHECK(first == x.value);
        CHECK(last == x.value);
      }
    };
    device1_round(pieces);
    // A block mapped after device 1 first touched the segment.
    piece later{30 * MiB, 0x33, alloc.allocate(30 * MiB, h(s0.s))};
    CHECK(backend.mapped_chunk_count() > chunks_before);
    device1_round({later});
    for (auto& x : pieces) alloc.deallocate(x.p);
    alloc.deallocate(later.p);
    CHECK(alloc.empty_cache() > 0);
  }
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  CHECK(cudaFree(sum) == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
}

TEST_CASE(
    "K8 on two GPUs: one thread enqueues half of a collective on device 0, allocates through the "
    "out-of-memory path with empty_cache:defer, then enqueues the other half on device 1, without "
    "a hang",
    "[gpu][multigpu][backends][cases][K8]") {
  STREAMSAFE_REQUIRE_GPUS(2);
  {
    shared_flags warm;
    warm_up(0, warm);
    warm_up(1, warm);
  }
  constexpr unsigned generation = 1;
  for (auto backend : {backend_kind::cuda_malloc, backend_kind::expandable}) {
    INFO("backend " << to_string(backend));
    shared_flags f;  // fresh flags for this round of the collective
    device_stream s0(0), t0(0), c0(0), c1(1);
    options o = with(backend, empty_cache_mode::defer);
    o.memory_limit_bytes = 256 * MiB;  // forces the out-of-memory path without filling the GPU
    cuda::allocator alloc(o);
    open_on_exit open_device0_half{f, 1};
    void* on_c0 = alloc.allocate(4096, 0,
                                 c0.s);  // the collective's stream is one the allocator has seen
    alloc.deallocate(on_c0);
    void* a = alloc.allocate(160 * MiB, 0, t0.s);  // another stream's pool: s0 cannot grow into it
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(kernels::launch_fill(a, 160 * MiB, 0x01, t0.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(t0.s) == cudaSuccess);
    alloc.deallocate(a);  // 162 MiB cached; 200 more on s0 only fit if the cache goes back

    // Catch2 assertions are not thread-safe: the driver thread only notes results.
    cudaError_t launch0 = cudaErrorUnknown, launch1 = cudaErrorUnknown, sync0 = cudaErrorUnknown,
                sync1 = cudaErrorUnknown;
    void* got = nullptr;
    std::string error;
    std::promise<void> done;
    std::future<void> finished = done.get_future();
    std::thread driver([&] {
      cudaSetDevice(0);
      launch0 = kernels::launch_exchange_flags(f.flags(), 0, 1, generation, k_wait_limit_ms,
                                               f.arrived(0), c0.s);
      try {
        got = alloc.allocate(200 * MiB, 0, s0.s);
      } catch (const std::exception& e) {
        error = e.what();
      }
      cudaSetDevice(1);
      launch1 = kernels::launch_exchange_flags(f.flags(), 1, 0, generation, k_wait_limit_ms,
                                               f.arrived(1), c1.s);
      sync1 = cudaStreamSynchronize(c1.s);
      cudaSetDevice(0);
      sync0 = cudaStreamSynchronize(c0.s);
      done.set_value();
    });
    const bool in_time = finished.wait_for(60s) == std::future_status::ready;
    if (!in_time) {
      f.set(0, generation);
      f.set(1, generation);
    }
    driver.join();
    CHECK(in_time);
    REQUIRE(launch0 == cudaSuccess);
    REQUIRE(launch1 == cudaSuccess);
    CHECK(sync0 == cudaSuccess);
    CHECK(sync1 == cudaSuccess);
    CHECK(f.arrived_value(0) ==
          1);  // device 0's half saw device 1's: the host never blocked in between
    CHECK(f.arrived_value(1) == 1);
    INFO(error);
    CHECK(got ==
          nullptr);  // every cached byte is fenced by the busy collective stream (all_streams)
    CHECK(error.find("out of memory on device 0") != std::string::npos);
    CHECK(error.find("waiting behind release fences") != std::string::npos);
    CHECK(alloc.device_allocator(0).pending_release_bytes() >= 160 * MiB);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    if (got) alloc.deallocate(got);
    CHECK(alloc.reclaim() >= 160 * MiB);  // the collective finished: the queue drains
    void* p = alloc.allocate(200 * MiB, 0, s0.s);
    alloc.deallocate(p);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
  }
}
