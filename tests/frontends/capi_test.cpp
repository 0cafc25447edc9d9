// Tests of the C API (streamsafe.h, libstreamsafe_c.so). The library keeps one process
// allocator, so the host tests share it: the first one switches it to two simulated devices
// (use_simulated()), and every test frees what it allocates and compares statistics by
// difference. The C example program on the GPU: examples_gpu_test.cpp.
#include "support/gpu.hpp"

#include <streamsafe/streamsafe.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// Switches the C API's process allocator to two simulated devices of 8 GiB, once.
void use_simulated() {
  static const bool done = [] {
    const streamsafe_status s = streamsafe_use_simulated_devices(2, std::size_t{8} << 30);
    if (s != STREAMSAFE_SUCCESS) {
      std::fprintf(stderr, "streamsafe_use_simulated_devices: %s\n", streamsafe_last_error());
    }
    return s == STREAMSAFE_SUCCESS;
  }();
  REQUIRE(done);
  REQUIRE(streamsafe_is_simulated() == 1);
  REQUIRE(streamsafe_sim_set_device(0) == STREAMSAFE_SUCCESS);
}

streamsafe_stats stats_of(int device) {
  streamsafe_stats s{};
  REQUIRE(streamsafe_get_stats(device, &s) == STREAMSAFE_SUCCESS);
  return s;
}

}  // namespace

TEST_CASE("The C API allocates on a stream and reuses a freed block on that stream", "[capi]") {
  use_simulated();
  void* stream = nullptr;
  REQUIRE(streamsafe_sim_create_stream(0, &stream) == STREAMSAFE_SUCCESS);
  const auto before = stats_of(0);
  void* p = nullptr;
  REQUIRE(streamsafe_malloc(&p, MiB, stream) == STREAMSAFE_SUCCESS);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 512 == 0);
  CHECK(stats_of(0).allocated_bytes.current ==
        before.allocated_bytes.current + static_cast<std::int64_t>(MiB));
  REQUIRE(streamsafe_free(p) == STREAMSAFE_SUCCESS);
  void* q = nullptr;
  REQUIRE(streamsafe_malloc(&q, MiB, stream) == STREAMSAFE_SUCCESS);
  CHECK(q == p);
  REQUIRE(streamsafe_free(q) == STREAMSAFE_SUCCESS);
  CHECK(stats_of(0).allocated_bytes.current == before.allocated_bytes.current);
  CHECK(streamsafe_free(nullptr) == STREAMSAFE_SUCCESS);
  CHECK(streamsafe_free_on_stream(nullptr, stream) == STREAMSAFE_SUCCESS);
}

TEST_CASE("Stream-ordered frees and recorded uses through the C API record one event each",
          "[capi]") {
  use_simulated();
  void *s1 = nullptr, *s2 = nullptr;
  REQUIRE(streamsafe_sim_create_stream(0, &s1) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_sim_create_stream(0, &s2) == STREAMSAFE_SUCCESS);
  const auto before = stats_of(0);
  void *a = nullptr, *b = nullptr, *c = nullptr;
  REQUIRE(streamsafe_malloc(&a, 4096, s1) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_malloc(&b, 4096, s1) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_malloc(&c, 4096, s1) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_free(a) == STREAMSAFE_SUCCESS);                // same stream: no event
  REQUIRE(streamsafe_free_on_stream(b, s2) == STREAMSAFE_SUCCESS);  // last use on s2: one event
  REQUIRE(streamsafe_record_stream(c, s2) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_free(c) == STREAMSAFE_SUCCESS);  // recorded use: one event
  CHECK(stats_of(0).events_recorded == before.events_recorded + 2);
  REQUIRE(streamsafe_sim_synchronize() == STREAMSAFE_SUCCESS);
  size_t released = 0;
  REQUIRE(streamsafe_reclaim(&released) == STREAMSAFE_SUCCESS);
  CHECK(stats_of(0).active_bytes.current == before.active_bytes.current);
}

TEST_CASE("A free through the C API is routed to the owning device whatever device is current",
          "[capi]") {
  use_simulated();
  void* p = nullptr;
  REQUIRE(streamsafe_malloc_on_device(&p, 3 * MiB, 1, nullptr) == STREAMSAFE_SUCCESS);
  int owner = -2;
  REQUIRE(streamsafe_owner_device(p, &owner) == STREAMSAFE_SUCCESS);
  CHECK(owner == 1);
  REQUIRE(streamsafe_sim_set_device(0) == STREAMSAFE_SUCCESS);
  const auto before = stats_of(1);
  REQUIRE(streamsafe_free(p) == STREAMSAFE_SUCCESS);
  CHECK(stats_of(1).allocated_bytes.current ==
        before.allocated_bytes.current - 3 * static_cast<std::int64_t>(MiB));
  REQUIRE(streamsafe_owner_device(p, &owner) == STREAMSAFE_SUCCESS);
  CHECK(owner == -1);

  REQUIRE(streamsafe_sim_set_device(1) == STREAMSAFE_SUCCESS);
  void* q = nullptr;
  REQUIRE(streamsafe_malloc(&q, 4096, nullptr) == STREAMSAFE_SUCCESS);  // the current device: 1
  REQUIRE(streamsafe_owner_device(q, &owner) == STREAMSAFE_SUCCESS);
  CHECK(owner == 1);
  REQUIRE(streamsafe_sim_set_device(0) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_free_on_stream(q, nullptr) == STREAMSAFE_SUCCESS);
}

TEST_CASE("Every misuse through the C API returns its status and a message, and changes nothing",
          "[capi]") {
  use_simulated();
  void* p = nullptr;
  REQUIRE(streamsafe_malloc(&p, 512, nullptr) == STREAMSAFE_SUCCESS);
  void* gone = nullptr;
  REQUIRE(streamsafe_malloc(&gone, 512, nullptr) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_free(gone) == STREAMSAFE_SUCCESS);
  const auto before = stats_of(0);

  CHECK(streamsafe_free(gone) == STREAMSAFE_ERROR_INVALID_POINTER);
  CHECK_THAT(streamsafe_last_error(),
             Catch::Contains("double free") && Catch::Contains("devices searched"));
  CHECK(streamsafe_free(static_cast<char*>(p) + 256) == STREAMSAFE_ERROR_INVALID_POINTER);
  CHECK_THAT(streamsafe_last_error(), Catch::Contains("interior pointer"));
  int host = 0;
  CHECK(streamsafe_record_stream(&host, nullptr) == STREAMSAFE_ERROR_INVALID_POINTER);
  CHECK_THAT(streamsafe_last_error(), Catch::Contains("unknown pointer"));
  void* out = &host;
  CHECK(streamsafe_malloc(&out, 0, nullptr) == STREAMSAFE_ERROR_INVALID_SIZE);
  CHECK(out == nullptr);
  CHECK(streamsafe_malloc(nullptr, 16, nullptr) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(streamsafe_malloc_on_device(&out, 16, 7, nullptr) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(streamsafe_last_error(), Catch::Contains("device 7 does not exist"));
  CHECK(streamsafe_get_stats(2, nullptr) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  streamsafe_stats s{};
  CHECK(streamsafe_get_stats(2, &s) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(streamsafe_malloc(&out, std::size_t{1} << 40, nullptr) == STREAMSAFE_ERROR_OUT_OF_MEMORY);
  CHECK_THAT(streamsafe_last_error(), Catch::Contains("out of memory on device 0"));
  CHECK(streamsafe_owner_device(p, nullptr) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(streamsafe_configure("no_such_key:1") == STREAMSAFE_ERROR_CONFIG);
  CHECK_THAT(streamsafe_last_error(), Catch::Contains("no_such_key"));
  CHECK(streamsafe_configure("backend:expandable") == STREAMSAFE_ERROR_STATE);
  CHECK(streamsafe_use_simulated_devices(1, MiB) == STREAMSAFE_ERROR_STATE);
  CHECK(streamsafe_configure(nullptr) == STREAMSAFE_ERROR_INVALID_ARGUMENT);

  const auto after = stats_of(0);
  CHECK(after.allocated_bytes.current == before.allocated_bytes.current);
  CHECK(after.reserved_bytes.current == before.reserved_bytes.current);
  CHECK(after.allocation.current == before.allocation.current);
  REQUIRE(streamsafe_free(p) == STREAMSAFE_SUCCESS);
}

TEST_CASE("The C API's last-error message belongs to the thread that failed", "[capi]") {
  use_simulated();
  std::string other_thread_message = "unset";
  std::thread t([&] { other_thread_message = streamsafe_last_error(); });
  CHECK(streamsafe_free(reinterpret_cast<void*>(0x1000)) == STREAMSAFE_ERROR_INVALID_POINTER);
  t.join();
  CHECK(other_thread_message.empty());
  const std::string mine = streamsafe_last_error();
  CHECK_FALSE(mine.empty());
  void* p = nullptr;
  REQUIRE(streamsafe_malloc(&p, 512, nullptr) == STREAMSAFE_SUCCESS);
  CHECK(mine == streamsafe_last_error());  // a success leaves the message as it was
  REQUIRE(streamsafe_free(p) == STREAMSAFE_SUCCESS);
}

TEST_CASE(
    "streamsafe_empty_cache gives back every cached byte of every device once streams are idle",
    "[capi]") {
  use_simulated();
  void *a = nullptr, *b = nullptr;
  REQUIRE(streamsafe_malloc_on_device(&a, 30 * MiB, 0, nullptr) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_malloc_on_device(&b, 30 * MiB, 1, nullptr) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_free(a) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_free(b) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_sim_synchronize() == STREAMSAFE_SUCCESS);
  size_t released = 0;
  REQUIRE(streamsafe_empty_cache(&released) == STREAMSAFE_SUCCESS);
  CHECK(released >= 60 * MiB);
  CHECK(stats_of(0).reserved_bytes.current == 0);
  CHECK(stats_of(1).reserved_bytes.current == 0);
  CHECK(streamsafe_empty_cache(nullptr) == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_reset_peak_stats(0) == STREAMSAFE_SUCCESS);
  CHECK(stats_of(0).reserved_bytes.peak == 0);
}

TEST_CASE("The C API lists every tag the process has named, count first", "[capi][sleep]") {
  REQUIRE(streamsafe_tag_push("capi-list-a") == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_tag_push("capi-list-b") == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_tag_pop() == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_tag_pop() == STREAMSAFE_SUCCESS);
  std::size_t count = 0;
  REQUIRE(streamsafe_list_tags(nullptr, 0, &count) == STREAMSAFE_SUCCESS);
  REQUIRE(count >= 2);
  std::vector<const char*> names(count + 1, nullptr);
  std::size_t again = 0;
  REQUIRE(streamsafe_list_tags(names.data(), names.size(), &again) == STREAMSAFE_SUCCESS);
  CHECK(again == count);
  CHECK(names[count] == nullptr);  // nothing written past the tags
  std::vector<std::string> listed(names.begin(), names.begin() + static_cast<long>(count));
  const auto a = std::find(listed.begin(), listed.end(), "capi-list-a");
  const auto b = std::find(listed.begin(), listed.end(), "capi-list-b");
  REQUIRE(a != listed.end());
  REQUIRE(b != listed.end());
  CHECK(a < b);  // in the order they were named
  // A short array gets the first names, and the count of all.
  const char* first = nullptr;
  REQUIRE(streamsafe_list_tags(&first, 1, &again) == STREAMSAFE_SUCCESS);
  CHECK(again == count);
  CHECK(first != nullptr);
  // Misuse: a clear status, a message naming the argument.
  CHECK(streamsafe_list_tags(nullptr, 0, nullptr) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(streamsafe_last_error()).find("count is NULL") != std::string::npos);
  CHECK(streamsafe_list_tags(nullptr, 3, &again) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(streamsafe_last_error()).find("names is NULL") != std::string::npos);
}

TEST_CASE("Every C API status has a name", "[capi]") {
  for (int s = STREAMSAFE_SUCCESS; s <= STREAMSAFE_ERROR_UNKNOWN; ++s) {
    const std::string name = streamsafe_status_string(static_cast<streamsafe_status>(s));
    CHECK(name.rfind("STREAMSAFE_", 0) == 0);
  }
  CHECK(std::string(streamsafe_status_string(STREAMSAFE_ERROR_STATE)) == "STREAMSAFE_ERROR_STATE");
}

TEST_CASE(
    "The C API announces a graph capture, ends it and releases the graph; misuse is an invalid "
    "argument",
    "[capi][graph]") {
  use_simulated();
  void* stream = nullptr;
  REQUIRE(streamsafe_sim_create_stream(0, &stream) == STREAMSAFE_SUCCESS);
  uint64_t graph = 0;
  REQUIRE(streamsafe_notify_capture_begin(stream, &graph) == STREAMSAFE_SUCCESS);
  CHECK(graph > 0);
  CHECK(streamsafe_notify_capture_begin(stream, nullptr) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(streamsafe_last_error()).find("already capturing") != std::string::npos);
  size_t released = 1;
  CHECK(streamsafe_empty_cache(&released) == STREAMSAFE_SUCCESS);
  CHECK(released == 0);  // nothing is released during a capture
  void* p = nullptr;
  REQUIRE(streamsafe_malloc(&p, MiB, stream) == STREAMSAFE_SUCCESS);  // from the graph's pool
  REQUIRE(streamsafe_free(p) == STREAMSAFE_SUCCESS);
  uint64_t ended = 0;
  REQUIRE(streamsafe_notify_capture_end(stream, &ended) == STREAMSAFE_SUCCESS);
  CHECK(ended == graph);
  CHECK(streamsafe_notify_capture_end(stream, &ended) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(ended == 0);
  REQUIRE(streamsafe_notify_graph_released(graph, 0) == STREAMSAFE_SUCCESS);
  CHECK(streamsafe_notify_graph_released(graph, 0) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(streamsafe_notify_capture_begin(nullptr, &graph) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("A block exported through the C API stays allocated until its release", "[capi][ipc]") {
  use_simulated();
  void* s = nullptr;
  REQUIRE(streamsafe_sim_create_stream(0, &s) == STREAMSAFE_SUCCESS);
  const std::int64_t before = stats_of(0).allocated_bytes.current;
  void* p = nullptr;
  REQUIRE(streamsafe_malloc(&p, MiB, s) == STREAMSAFE_SUCCESS);
  void* h = nullptr;
  size_t n = 0;
  REQUIRE(streamsafe_export_block(p, &h, &n) == STREAMSAFE_SUCCESS);
  REQUIRE(n > 0);
  // One process plays both ends: the simulated device's import is a view at the same address.
  void* q = nullptr;
  size_t q_bytes = 0;
  REQUIRE(streamsafe_import_block(h, n, -1, &q, &q_bytes) == STREAMSAFE_SUCCESS);
  CHECK(q == p);
  CHECK(q_bytes >= MiB);
  void* again = nullptr;
  CHECK(streamsafe_import_block(h, n, -1, &again, nullptr) == STREAMSAFE_ERROR_IPC);
  unsigned char r[STREAMSAFE_IPC_RELEASE_BYTES];
  REQUIRE(streamsafe_release_import(q, s, r) == STREAMSAFE_SUCCESS);
  CHECK(streamsafe_release_import(q, s, r) == STREAMSAFE_ERROR_IPC);
  REQUIRE(streamsafe_free(p) == STREAMSAFE_SUCCESS);
  CHECK(stats_of(0).allocated_bytes.current > before);  // held: still allocated
  CHECK(streamsafe_free(p) == STREAMSAFE_ERROR_INVALID_POINTER);
  REQUIRE(streamsafe_notify_import_released(r, sizeof r) == STREAMSAFE_SUCCESS);
  CHECK(streamsafe_notify_import_released(r, sizeof r) == STREAMSAFE_ERROR_IPC);
  REQUIRE(streamsafe_sim_synchronize() == STREAMSAFE_SUCCESS);
  REQUIRE(streamsafe_reclaim(nullptr) == STREAMSAFE_SUCCESS);
  CHECK(stats_of(0).allocated_bytes.current == before);
  void* h2 = nullptr;
  size_t n2 = 0;
  CHECK(streamsafe_export_block(p, &h2, &n2) == STREAMSAFE_ERROR_INVALID_POINTER);
  const char junk[] = "not a handle";
  CHECK(streamsafe_import_block(junk, sizeof junk, -1, &q, nullptr) == STREAMSAFE_ERROR_IPC);
  CHECK(std::string(streamsafe_last_error()).find("not an IPC handle") != std::string::npos);
  CHECK(std::string(streamsafe_status_string(STREAMSAFE_ERROR_IPC)) == "STREAMSAFE_ERROR_IPC");
  streamsafe_ipc_free(h);
}
