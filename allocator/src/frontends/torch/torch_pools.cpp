// streamsafe PyTorch extension: CUDA graph pools (torch.cuda.graph, pool=, MemPool):
// beginAllocateToPool / endAllocateToPool / releasePool onto streamsafe's capture calls
// (notify_capture_begin with a shared pool, notify_capture_end, notify_graph_released).
// pools_mu_ guards pools_ and captures_, a leaf lock never held across a call into streamsafe.
#include "extension_allocator.hpp"

namespace streamsafe::torch_ext {

void torch_allocator::beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                                          std::function<bool(cudaStream_t)> filter) {
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  const bool capturing = status == cudaStreamCaptureStatusActive;
  TORCH_CHECK(
      capturing || !filter || !filter(stream),
      "streamsafe: allocating to a memory pool outside a CUDA graph capture "
      "(torch.cuda.use_mem_pool, "
      "beginAllocateCurrentThreadToPool / CurrentStreamToPool, torch.compile cudagraph trees) is "
      "not "
      "supported; streamsafe keeps private pools for CUDA graph captures only (torch.cuda.graph)");
  // Captures into one pool (torch.cuda.graph(pool=...), a MemPool) share streamsafe's private
  // pool of the pool's first graph: blocks the earlier graphs freed serve the later ones.
  std::uint64_t share = 0;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    if (auto it = pools_.find(mempool_id); it != pools_.end() && !it->second.graphs.empty()) {
      share = it->second.graphs.front();
    } else {
      for (const capture_state& c : captures_) {
        if (c.pool == mempool_id && c.device == device) share = c.graph;
      }
    }
  }
  std::uint64_t graph = 0;
  guarded("CUDA graph capture begin", [&] { graph = ss_->notify_capture_begin(stream, share); });
  std::lock_guard<std::mutex> lock(pools_mu_);
  pool_state& pool = pools_[mempool_id];
  pool.device = device;
  ++pool.use_count;
  captures_.push_back(capture_state{mempool_id, device, stream, graph});
}

void torch_allocator::endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  capture_state cap{};
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = std::find_if(captures_.rbegin(), captures_.rend(), [&](const capture_state& c) {
      return c.pool == mempool_id && c.device == device;
    });
    TORCH_CHECK(it != captures_.rend(),
                "streamsafe: endAllocateToPool without a capture into pool (", mempool_id.first,
                ", ", mempool_id.second, ") on device ", static_cast<int>(device));
    cap = *it;
    captures_.erase(std::next(it).base());
    pools_[mempool_id].graphs.push_back(cap.graph);
  }
  guarded("CUDA graph capture end", [&] { ss_->notify_capture_end(cap.stream); });
}

// PyTorch counts a pool's users (each graph captured into it, each MemPool object); when the
// last one lets go, every graph captured into the pool is released to streamsafe.
void torch_allocator::releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  std::vector<std::uint64_t> graphs;
  int pool_device = device;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = pools_.find(mempool_id);
    if (it == pools_.end()) return;
    if (--it->second.use_count > 0) return;
    graphs = std::move(it->second.graphs);
    pool_device = it->second.device;
    pools_.erase(it);
  }
  for (std::uint64_t g : graphs)
    guarded("CUDA graph release", [&] { ss_->notify_graph_released(g, pool_device); });
}

}  // namespace streamsafe::torch_ext
