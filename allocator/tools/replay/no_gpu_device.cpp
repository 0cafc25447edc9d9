// streamsafe-replay without CUDA (STREAMSAFE_ENABLE_CUDA=OFF): --gpu is refused; the simulated
// device replays as usual.
#include "replay.hpp"

#include <streamsafe/core/errors.hpp>

#include <string>

namespace streamsafe::replay {

std::unique_ptr<replay_device> make_gpu_device(int device, backend_kind /*kind*/) {
  throw backend_error("streamsafe-replay: --gpu " + std::to_string(device) +
                      ": built without CUDA (STREAMSAFE_ENABLE_CUDA=OFF)");
}

}  // namespace streamsafe::replay
