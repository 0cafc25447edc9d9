// streamsafe core: the out-of-line part of the backend interface (device_backend.hpp): the
// default implementations of its optional calls (stream-ordered copies for pause/resume offload;
// IPC), which refuse by name.
#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

namespace streamsafe {

void throw_unsupported(const device_backend& backend, const char* call) {
  throw backend_error(std::string("streamsafe: ") + call + " is not supported by the " +
                      backend.name() + " backend of device " + std::to_string(backend.device()));
}

stream_handle device_backend::create_stream() { throw_unsupported(*this, "create_stream"); }

void device_backend::destroy_stream(stream_handle /*stream*/) {
  throw_unsupported(*this, "destroy_stream");
}

bool device_backend::synchronize_event_for(event_handle event, std::uint64_t timeout_us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  auto pause = std::chrono::microseconds(10);
  while (!query_event(event)) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return true;
}

void device_backend::copy_async(void* /*dst*/, const void* /*src*/, std::size_t /*bytes*/,
                                stream_handle /*stream*/) {
  throw_unsupported(*this, "copy_async");
}

}  // namespace streamsafe
