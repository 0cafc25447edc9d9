// Tests of the two CUDA device backends (cuda_malloc_backend, expandable_backend), the device
// guard and the driver-free GPU discovery, on the GPU: each test skips itself, with a message,
// where there is none. A machine without a GPU or a driver: cuda_backends_test.cpp.
//
// Thread safety: the tests run one at a time; the host-function gate below is the only shared
// state.
#include "support/gpu.hpp"

#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/device_guard.hpp>
#include <streamsafe/backends/driver_api.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/backends/gpu.hpp>
#include <streamsafe/core/errors.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace {

using streamsafe::backend_error;
using streamsafe::event_handle;
using streamsafe::stream_handle;
using streamsafe::cuda::cuda_malloc_backend;
using streamsafe::cuda::device_guard;
using streamsafe::cuda::expandable_backend;

constexpr std::size_t mib = std::size_t{1} << 20;

// A stream that host work can hold back: block() enqueues a host function that spins until the
// gate opens. gate_closed closes the gate for its scope; declare it AFTER the streams it
// blocks, so that it opens before their destructors synchronise them.
std::atomic<bool> gate_open{true};

void CUDART_CB wait_for_gate(void* /*unused*/) {
  while (!gate_open.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
}

struct gate_closed {
  gate_closed() { gate_open.store(false); }
  ~gate_closed() { gate_open.store(true); }
  gate_closed(const gate_closed&) = delete;
  gate_closed& operator=(const gate_closed&) = delete;
  void block(cudaStream_t stream) const {
    REQUIRE(cudaLaunchHostFunc(stream, &wait_for_gate, nullptr) == cudaSuccess);
  }
};

struct test_stream {
  cudaStream_t stream = nullptr;
  test_stream() {
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~test_stream() {
    (void)cudaStreamSynchronize(stream);
    (void)cudaStreamDestroy(stream);
  }
  test_stream(const test_stream&) = delete;
  test_stream& operator=(const test_stream&) = delete;
  stream_handle handle() const { return reinterpret_cast<stream_handle>(stream); }
};

// cudaMalloc'ed memory freed on scope exit (the out-of-memory test's ballast).
struct device_ballast {
  void* ptr = nullptr;
  device_ballast() = default;
  ~device_ballast() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
  device_ballast(const device_ballast&) = delete;
  device_ballast& operator=(const device_ballast&) = delete;
};

char* at(void* base, std::size_t offset) { return static_cast<char*>(base) + offset; }

bool all_bytes_are(const void* device_ptr, std::size_t size, unsigned char value) {
  std::vector<unsigned char> host(size);
  REQUIRE(cudaMemcpy(host.data(), device_ptr, size, cudaMemcpyDeviceToHost) == cudaSuccess);
  return std::all_of(host.begin(), host.end(), [value](unsigned char b) { return b == value; });
}

}  // namespace

TEMPLATE_TEST_CASE(
    "A CUDA backend hands out segments that the device can write and the host "
    "can read back",
    "[gpu][backends]", cuda_malloc_backend, expandable_backend) {
  STREAMSAFE_REQUIRE_GPU();
  TestType backend(0);
  REQUIRE(backend.device() == 0);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  backend.memory_info(free_bytes, total_bytes);
  REQUIRE(total_bytes > 0);
  REQUIRE(free_bytes <= total_bytes);

  for (const std::size_t size : {std::size_t{512}, 3 * mib, 64 * mib}) {
    void* segment = backend.allocate_segment(size);
    REQUIRE(segment != nullptr);
    REQUIRE(reinterpret_cast<std::uintptr_t>(segment) % 512 == 0);
    REQUIRE(cudaMemset(segment, 0x5a, size) == cudaSuccess);
    REQUIRE(all_bytes_are(segment, size, 0x5a));
    backend.free_segment(segment, size);
  }
  REQUIRE(cudaGetLastError() == cudaSuccess);
}

TEMPLATE_TEST_CASE(
    "A CUDA backend returns nullptr for an impossible segment size and leaves no "
    "error behind",
    "[gpu][backends]", cuda_malloc_backend, expandable_backend) {
  STREAMSAFE_REQUIRE_GPU();
  TestType backend(0);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  backend.memory_info(free_bytes, total_bytes);
  const std::size_t impossible = (2 * total_bytes + 512) / 512 * 512;
  REQUIRE(backend.allocate_segment(impossible) == nullptr);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaPeekAtLastError() == cudaSuccess);

  void* segment = backend.allocate_segment(mib);  // the device still works
  REQUIRE(segment != nullptr);
  REQUIRE(cudaMemset(segment, 1, mib) == cudaSuccess);
  REQUIRE(all_bytes_are(segment, mib, 1));
  backend.free_segment(segment, mib);
}

TEMPLATE_TEST_CASE(
    "A CUDA backend's events record, report pending work as incomplete, "
    "synchronize and then report completion",
    "[gpu][backends]", cuda_malloc_backend, expandable_backend) {
  STREAMSAFE_REQUIRE_GPU();
  TestType backend(0);
  test_stream stream;
  const event_handle event = backend.create_event();
  REQUIRE(event != 0);
  REQUIRE(backend.query_event(event));  // never recorded: complete
  {
    gate_closed gate;
    gate.block(stream.stream);
    backend.record_event(event, stream.handle());
    REQUIRE_FALSE(backend.query_event(event));
    REQUIRE(cudaGetLastError() == cudaSuccess);  // "not ready" left nothing behind
  }
  backend.synchronize_event(event);
  REQUIRE(backend.query_event(event));

  backend.record_event(event, 0);  // the legacy default stream
  backend.synchronize_event(event);
  REQUIRE(backend.query_event(event));
  backend.synchronize_device();
  backend.destroy_event(event);
  backend.destroy_event(0);  // no event: nothing happens
  REQUIRE(cudaGetLastError() == cudaSuccess);
}

TEMPLATE_TEST_CASE(
    "A CUDA backend's stream_wait_event orders work on one stream after an event "
    "recorded on another without blocking the host",
    "[gpu][backends]", cuda_malloc_backend, expandable_backend) {
  STREAMSAFE_REQUIRE_GPU();
  TestType backend(0);
  const std::size_t size = 8 * mib;
  void* segment = backend.allocate_segment(size);
  REQUIRE(segment != nullptr);
  const event_handle first_done = backend.create_event();
  const event_handle second_done = backend.create_event();
  {
    test_stream first;
    test_stream second;
    {
      gate_closed gate;
      gate.block(first.stream);
      REQUIRE(cudaMemsetAsync(segment, 1, size, first.stream) == cudaSuccess);
      backend.record_event(first_done, first.handle());
      backend.stream_wait_event(second.handle(), first_done);  // returns although first waits
      REQUIRE(cudaMemsetAsync(segment, 2, size, second.stream) == cudaSuccess);
      backend.record_event(second_done, second.handle());
      REQUIRE_FALSE(backend.query_event(second_done));  // held back behind the gate
      REQUIRE_FALSE(backend.query_event(first_done));
    }
    backend.synchronize_event(second_done);
    REQUIRE(backend.query_event(first_done));
  }
  REQUIRE(all_bytes_are(segment, size, 2));  // the second stream's write landed last
  backend.destroy_event(first_done);
  backend.destroy_event(second_done);
  backend.free_segment(segment, size);
  REQUIRE(cudaGetLastError() == cudaSuccess);
}

TEST_CASE(
    "The expandable backend maps and unmaps several chunks, and data in the chunks that "
    "stay mapped survives",
    "[gpu][backends]") {
  STREAMSAFE_REQUIRE_GPU();
  expandable_backend backend(0);
  REQUIRE(backend.supports_expandable());
  REQUIRE(std::string(backend.name()) == "expandable");
  const std::size_t g = backend.map_granularity_bytes();
  REQUIRE(g >= 2 * mib);

  void* base = backend.reserve_address_range(4 * g);
  REQUIRE(base != nullptr);
  REQUIRE(reinterpret_cast<std::uintptr_t>(base) % g == 0);
  for (std::size_t i = 0; i < 4; ++i) REQUIRE(backend.map(at(base, i * g), g));  // four chunks
  REQUIRE(backend.mapped_chunk_count() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    REQUIRE(cudaMemset(at(base, i * g), static_cast<int>(0x10 + i), g) == cudaSuccess);
  }
  backend.synchronize_device();  // the allocator's fence, in the test's hands here

  REQUIRE_THROWS_AS(backend.unmap(at(base, g), g / 2), backend_error);  // part of a chunk
  backend.unmap(at(base, g), 2 * g);  // the middle two, in one call
  REQUIRE(backend.mapped_chunk_count() == 2);
  REQUIRE(all_bytes_are(at(base, 0), g, 0x10));
  REQUIRE(all_bytes_are(at(base, 3 * g), g, 0x13));

  REQUIRE(backend.map(at(base, g), 2 * g));  // mapped back as one physical allocation
  REQUIRE(cudaMemset(at(base, g), 0x21, 2 * g) == cudaSuccess);
  REQUIRE(all_bytes_are(at(base, 0), g, 0x10));
  REQUIRE(all_bytes_are(at(base, g), 2 * g, 0x21));
  REQUIRE(all_bytes_are(at(base, 3 * g), g, 0x13));

  REQUIRE_THROWS_AS(backend.map(at(base, g), g), backend_error);                 // already mapped
  REQUIRE_THROWS_AS(backend.unmap(at(base, 512), g), backend_error);             // not aligned
  REQUIRE_THROWS_AS(backend.release_address_range(base, 4 * g), backend_error);  // still mapped
  REQUIRE_THROWS_AS(backend.unmap(at(base, g), g), backend_error);  // half of a mapped range
  REQUIRE(backend.mapped_chunk_count() == 3);

  backend.synchronize_device();
  backend.unmap(base, 4 * g);  // the union of three map() ranges
  REQUIRE(backend.mapped_chunk_count() == 0);
  REQUIRE_THROWS_AS(backend.unmap(base, g), backend_error);  // nothing mapped there
  backend.release_address_range(base, 4 * g);

  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  backend.memory_info(free_bytes, total_bytes);
  const std::size_t impossible = (2 * total_bytes + g) / g * g;
  void* huge = backend.reserve_address_range(impossible);  // address space only
  REQUIRE_FALSE(backend.map(huge, impossible));
  REQUIRE(backend.mapped_chunk_count() == 0);
  backend.release_address_range(huge, impossible);
  REQUIRE(cudaGetLastError() == cudaSuccess);
}

TEST_CASE(
    "The expandable backend's map returns false and leaves nothing mapped when physical "
    "memory runs out partway through",
    "[gpu][backends]") {
  STREAMSAFE_REQUIRE_GPU();
  expandable_backend backend(0);
  const std::size_t g = backend.map_granularity_bytes();
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  backend.memory_info(free_bytes, total_bytes);

  // Ballast: leave only a few chunks' worth of memory free (back off until cudaMalloc agrees).
  device_ballast ballast;
  for (std::size_t keep = 8 * g; keep < free_bytes && ballast.ptr == nullptr; keep *= 2) {
    if (cudaMalloc(&ballast.ptr, free_bytes - keep) != cudaSuccess) {
      (void)cudaGetLastError();
      ballast.ptr = nullptr;
    }
  }
  REQUIRE(ballast.ptr != nullptr);
  std::size_t free_before = 0;
  backend.memory_info(free_before, total_bytes);

  const std::size_t size = (free_before / g + 16) * g;  // more than is left
  void* base = backend.reserve_address_range(size);
  REQUIRE_FALSE(backend.map(base, size));
  REQUIRE(backend.mapped_chunk_count() == 0);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  std::size_t free_after = 0;
  backend.memory_info(free_after, total_bytes);
  REQUIRE(free_after + 4 * g >= free_before);  // the partial mapping was given back

  REQUIRE(cudaFree(ballast.ptr) == cudaSuccess);
  ballast.ptr = nullptr;
  REQUIRE(backend.map(base, 4 * g));  // and the range works once memory is there
  REQUIRE(cudaMemset(base, 7, 4 * g) == cudaSuccess);
  REQUIRE(all_bytes_are(base, 4 * g, 7));
  backend.unmap(base, 4 * g);
  backend.release_address_range(base, size);
}

TEST_CASE(
    "The cuda_malloc backend refuses reserve, map and unmap because it has no expandable "
    "segments",
    "[gpu][backends]") {
  STREAMSAFE_REQUIRE_GPU();
  cuda_malloc_backend backend(0);
  REQUIRE(std::string(backend.name()) == "cuda_malloc");
  REQUIRE_FALSE(backend.supports_expandable());
  REQUIRE_THROWS_AS(backend.reserve_address_range(2 * mib), backend_error);
  REQUIRE_THROWS_AS(backend.release_address_range(nullptr, 2 * mib), backend_error);
  REQUIRE_THROWS_AS(backend.map(nullptr, 2 * mib), backend_error);
  REQUIRE_THROWS_AS(backend.unmap(nullptr, 2 * mib), backend_error);
}

TEST_CASE(
    "A device guard makes a device current and restores the previous one, and backend "
    "calls leave the caller's current device as it was",
    "[gpu][backends]") {
  STREAMSAFE_REQUIRE_GPU();
  const int count = streamsafe::cuda::device_count();
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  {
    device_guard guard(0);  // already current: nothing to switch
    REQUIRE(streamsafe::cuda::current_device() == 0);
    REQUIRE(guard.previous_device() == 0);
  }
  REQUIRE(streamsafe::cuda::current_device() == 0);
  REQUIRE_THROWS_AS(device_guard(count), backend_error);  // no such device
  REQUIRE(streamsafe::cuda::current_device() == 0);
  REQUIRE(cudaGetLastError() == cudaSuccess);

  if (count < 2) {
    WARN("only one GPU: switching between devices is not exercised");
    return;
  }
  const int last = count - 1;
  {
    device_guard outer(last);
    REQUIRE(streamsafe::cuda::current_device() == last);
    {
      device_guard inner(0);
      REQUIRE(streamsafe::cuda::current_device() == 0);
    }
    REQUIRE(streamsafe::cuda::current_device() == last);
  }
  REQUIRE(streamsafe::cuda::current_device() == 0);

  cuda_malloc_backend plain(last);
  expandable_backend expandable(last);
  for (streamsafe::device_backend* backend :
       {static_cast<streamsafe::device_backend*>(&plain),
        static_cast<streamsafe::device_backend*>(&expandable)}) {
    void* segment = backend->allocate_segment(2 * mib);
    REQUIRE(segment != nullptr);
    REQUIRE(streamsafe::cuda::current_device() == 0);
    cudaPointerAttributes attributes{};
    REQUIRE(cudaPointerGetAttributes(&attributes, segment) == cudaSuccess);
    REQUIRE(attributes.device == last);
    const event_handle event = backend->create_event();
    backend->record_event(event, 0);
    backend->synchronize_event(event);
    backend->destroy_event(event);
    backend->free_segment(segment, 2 * mib);
    REQUIRE(streamsafe::cuda::current_device() == 0);
  }
}
