// streamsafe PyTorch extension: the checkpoint of a CUDA graph pool, getCheckpointState /
// setCheckpointPoolState, which torch.compile(mode="reduce-overhead")'s cudagraph trees take
// after recording a graph and restore when they switch to another path of the tree.
//
// The state handed to Python (opaque there) is a pool_checkpoint_state: streamsafe's
// checkpoint of the private pool of the pool's graphs (core/pool_checkpoint.hpp). Restoring it
// frees every block of the pool allocated now (CheckpointDelta::ptrs_freed) and allocates the
// checkpoint's allocated blocks again at their addresses (CheckpointDelta::dataptrs_allocd,
// each with the allocator's deleter: PyTorch gives it to the storages named in
// storages_to_add_deleters_to and releases the others' context, leaving them allocated until
// raw_delete). The core keeps its safety rules: a block freed while other streams may still
// read it waits for them before its memory serves anyone (core's restore_graph_pool).
// pools_mu_ is held only to find the pool's graph and to update pool_live_, never across the
// call into streamsafe.
#include "extension_allocator.hpp"

namespace streamsafe::torch_ext {

namespace {

struct pool_checkpoint_state final : cca::AllocatorState {
  MempoolId_t pool{0, 0};
  c10::DeviceIndex device = 0;
  streamsafe::pool_checkpoint checkpoint;
};

}  // namespace

// A streamsafe graph captured into the pool (any one: they share its private pool), or 0.
std::uint64_t torch_allocator::graph_of_pool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  if (auto it = pools_.find(mempool_id);
      it != pools_.end() && it->second.device == device && !it->second.graphs.empty())
    return it->second.graphs.front();
  for (const capture_state& c : captures_)
    if (c.pool == mempool_id && c.device == device) return c.graph;
  return 0;
}

std::shared_ptr<cca::AllocatorState> torch_allocator::getCheckpointState(c10::DeviceIndex device,
                                                                         MempoolId_t id) {
  check_device(device);
  const std::uint64_t graph = graph_of_pool(device, id);
  TORCH_CHECK(graph != 0, "streamsafe: getCheckpointState: no CUDA graph was captured into pool (",
              id.first, ", ", id.second, ") on device ", static_cast<int>(device),
              " (only CUDA graph pools can be checkpointed)");
  auto state = std::make_shared<pool_checkpoint_state>();
  state->pool = id;
  state->device = device;
  guarded("getCheckpointState",
          [&] { state->checkpoint = ss_->device_allocator(device).checkpoint_graph_pool(graph); });
  return state;
}

cca::CheckpointDelta torch_allocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) {
  check_device(device);
  const auto state = std::dynamic_pointer_cast<pool_checkpoint_state>(pps);
  TORCH_CHECK(state,
              "streamsafe: setCheckpointPoolState: the state is not one of streamsafe's "
              "checkpoints (it must come from getCheckpointState of this allocator)");
  TORCH_CHECK(state->device == device,
              "streamsafe: setCheckpointPoolState: the checkpoint is of "
              "device ",
              static_cast<int>(state->device), ", not ", static_cast<int>(device));
  streamsafe::pool_restore restored;
  guarded("setCheckpointPoolState",
          [&] { restored = ss_->device_allocator(device).restore_graph_pool(state->checkpoint); });
  const bool history = history_enabled_.load(std::memory_order_relaxed) ||
                       has_trackers_.load(std::memory_order_relaxed);
  std::unordered_map<std::uintptr_t, std::size_t> requested;
  for (const auto& seg : state->checkpoint.segments)
    for (const auto& b : seg.blocks)
      if (b.allocated) requested[b.address] = b.requested_bytes;
  cca::CheckpointDelta delta;
  delta.ptrs_freed = restored.freed;
  for (void* p : restored.freed) {
    if (history) note_free(p);
    forget_pool_live(p);
  }
  const c10::Device where(c10::DeviceType::CUDA, device);
  for (void* p : restored.allocated) {
    note_pool_live(p, state->pool, device);
    if (history) note_alloc(p, requested[reinterpret_cast<std::uintptr_t>(p)], device, nullptr);
    delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn, where);
  }
  return delta;
}

}  // namespace streamsafe::torch_ext
