// streamsafe core: the default implementations of device_backend's optional calls (the
// stream-ordered copies that pause/resume offload needs): a backend without them refuses by name.
#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <string>

namespace streamsafe {
namespace {

[[noreturn]] void unsupported(const device_backend& backend, const char* call) {
  throw backend_error(std::string("streamsafe: ") + call + " is not supported by the " +
                      backend.name() + " backend of device " + std::to_string(backend.device()));
}

}  // namespace

stream_handle device_backend::create_stream() { unsupported(*this, "create_stream"); }

void device_backend::destroy_stream(stream_handle /*stream*/) {
  unsupported(*this, "destroy_stream");
}

void device_backend::copy_async(void* /*dst*/, const void* /*src*/, std::size_t /*bytes*/,
                                stream_handle /*stream*/) {
  unsupported(*this, "copy_async");
}

}  // namespace streamsafe
