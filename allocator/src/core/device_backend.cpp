// streamsafe core: the out-of-line part of the backend interface (device_backend.hpp): the
// default implementations of its optional calls (stream-ordered copies for pause/resume offload;
// IPC), which refuse by name.
#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <string>

namespace streamsafe {

void throw_unsupported(const device_backend& backend, const char* call) {
  throw backend_error(std::string("streamsafe: ") + call + " is not supported by the " +
                      backend.name() + " backend of device " + std::to_string(backend.device()));
}

stream_handle device_backend::create_stream() { throw_unsupported(*this, "create_stream"); }

void device_backend::destroy_stream(stream_handle /*stream*/) {
  throw_unsupported(*this, "destroy_stream");
}

void device_backend::copy_async(void* /*dst*/, const void* /*src*/, std::size_t /*bytes*/,
                                stream_handle /*stream*/) {
  throw_unsupported(*this, "copy_async");
}

}  // namespace streamsafe
