// streamsafe: the out-of-line part of the backend interface (device_backend.hpp): the error of
// the default implementations of optional calls.
#include <streamsafe/backends/device_backend.hpp>
#include <streamsafe/core/errors.hpp>

#include <string>

namespace streamsafe {

void throw_unsupported(const device_backend& backend, const char* call) {
  throw backend_error(std::string("streamsafe: ") + call + " is not supported by the " +
                      backend.name() + " backend of device " + std::to_string(backend.device()));
}

}  // namespace streamsafe
