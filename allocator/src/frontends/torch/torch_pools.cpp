// streamsafe PyTorch extension: CUDA graph pools (torch.cuda.graph, pool=, MemPool):
// beginAllocateToPool / endAllocateToPool / releasePool onto streamsafe's capture calls
// (notify_capture_begin with a shared pool, notify_capture_end, notify_graph_released), and the
// routes outside a capture: into a graph's pool (cudagraph trees' beginAllocateCurrentThreadToPool)
// the core's begin_allocate_to_graph_pool; use_mem_pool's (torch_mempool.cpp serves them).
// pools_mu_ guards pools_, captures_ and routes_; never held across an allocation or a capture
// call into streamsafe.
#include "extension_allocator.hpp"

namespace streamsafe::torch_ext {

void torch_allocator::beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                                          std::function<bool(cudaStream_t)> filter) {
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  const bool capturing = status == cudaStreamCaptureStatusActive;
  // CUDAGraph::capture_begin calls this just before cudaStreamBeginCapture, with a filter that
  // takes only streams capturing into its graph: false for the current stream now. Every other
  // caller (use_mem_pool, cudagraph trees' beginAllocateCurrentThreadToPool / StreamToPool)
  // gives a filter that takes the current stream: a route outside a capture.
  if (!capturing && filter && filter(stream)) {
    // A pool a CUDA graph was captured into (cudagraph trees' warm-up and eager runs between
    // captures): the allocations go to streamsafe's private pool of its graphs, so that its
    // checkpoint, segments and statistics hold them. Any other pool: a tag (torch_mempool.cpp).
    std::uint64_t graph_route = 0;
    if (const std::uint64_t graph = graph_of_pool(device, mempool_id); graph != 0) {
      guarded("allocation into a CUDA graph pool", [&] {
        graph_route = ss_->device_allocator(device).begin_allocate_to_graph_pool(
            graph, [f = filter](streamsafe::stream_handle s) {
              return f(reinterpret_cast<cudaStream_t>(s));  // 0: the default stream
            });
      });
    }
    const streamsafe::tag_id tag = graph_route != 0 ? 0 : streamsafe::tag_of(pool_tag(mempool_id));
    std::lock_guard<std::mutex> lock(pools_mu_);
    pool_state& pool = pools_[mempool_id];
    pool.device = device;
    ++pool.use_count;
    pool_route r;
    r.pool = mempool_id;
    r.device = device;
    r.filter = std::move(filter);
    r.tag = tag;
    r.instance = graph_route != 0 ? nullptr : pool.instance;
    r.graph_route = graph_route;
    routes_.push_back(std::move(r));
    n_routes_.store(static_cast<int>(routes_.size()), std::memory_order_release);
    return;
  }
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
  n_captures_.store(static_cast<int>(captures_.size()), std::memory_order_release);
}

void torch_allocator::endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  const cudaStream_t current = c10::cuda::getCurrentCUDAStream(device).stream();
  capture_state cap{};
  {
    std::unique_lock<std::mutex> lock(pools_mu_);
    const auto capture_of = [&](bool on_current_stream) {
      return std::find_if(captures_.rbegin(), captures_.rend(), [&](const capture_state& c) {
        return c.pool == mempool_id && c.device == device &&
               (!on_current_stream || c.stream == current);
      });
    };
    auto it = capture_of(true);  // CUDAGraph::capture_end runs on the capturing stream
    if (it == captures_.rend()) {
      // A route: the calling thread's own (its filter takes the current stream), else the
      // latest route to the pool.
      auto route = std::find_if(routes_.rbegin(), routes_.rend(), [&](const pool_route& r) {
        return r.pool == mempool_id && r.device == device && r.filter && r.filter(current);
      });
      if (route == routes_.rend()) {
        route = std::find_if(routes_.rbegin(), routes_.rend(), [&](const pool_route& r) {
          return r.pool == mempool_id && r.device == device;
        });
      }
      if (route != routes_.rend()) {
        const std::uint64_t graph_route = route->graph_route;
        routes_.erase(std::next(route).base());
        n_routes_.store(static_cast<int>(routes_.size()), std::memory_order_release);
        lock.unlock();
        if (graph_route != 0) {
          guarded("end of an allocation into a CUDA graph pool",
                  [&] { ss_->device_allocator(device).end_allocate_to_graph_pool(graph_route); });
        }
        return;  // PyTorch's releasePool follows and drops the route's use of the pool
      }
      it = capture_of(false);
    }
    TORCH_CHECK(it != captures_.rend(),
                "streamsafe: endAllocateToPool without a capture or use_mem_pool into pool (",
                mempool_id.first, ", ", mempool_id.second, ") on device ",
                static_cast<int>(device));
    cap = *it;
    captures_.erase(std::next(it).base());
    n_captures_.store(static_cast<int>(captures_.size()), std::memory_order_release);
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
    // A MemPool's own allocator: its memory is given back at the next emptyCache once free.
    if (it->second.instance) it->second.instance->in_use = false;
    pools_.erase(it);
  }
  for (std::uint64_t g : graphs)
    guarded("CUDA graph release", [&] { ss_->notify_graph_released(g, pool_device); });
}

}  // namespace streamsafe::torch_ext
