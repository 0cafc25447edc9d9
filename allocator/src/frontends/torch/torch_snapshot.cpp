// streamsafe PyTorch extension: snapshot(), streamsafe's segments and blocks in PyTorch's
// SnapshotInfo (torch.cuda.memory._snapshot(), memory_snapshot(), torch.cuda._memory_viz), with
// the history's trace entries and the Python context of live blocks when history is on.
#include "extension_allocator.hpp"

namespace streamsafe::torch_ext {

void torch_allocator::finish_releases_for_snapshot(MempoolId_t mempool_id) {
  const bool wait = history_enabled_.load();
  const bool every_pool = mempool_id.first == 0 && mempool_id.second == 0;
  std::vector<streamsafe::caching_allocator*> allocs;
  for (int d = 0; d < ss_->device_count(); ++d)
    if (streamsafe::caching_allocator* a = ss_->find_device_allocator(d)) allocs.push_back(a);
  for (const std::shared_ptr<pool_instance>& inst : instances())
    if (every_pool || inst->id == mempool_id)
      if (streamsafe::caching_allocator* a = inst->alloc->find_device_allocator(inst->device))
        allocs.push_back(a);
  for (streamsafe::caching_allocator* a : allocs) {
    try {
      // A failed driver call leaves the memory queued (nothing lost), and the snapshot shows it.
      (void)(wait ? a->finish_releases() : a->reclaim());
    } catch (const std::exception& e) {
      TORCH_WARN("streamsafe: memory snapshot: finishing releases: ", e.what());
    }
  }
}

// mempool_id {0, 0}: every pool's segments (MemPools' segments name their pool in
// owner_private_pool_id); a MemPool's id: that pool's segments only (MemPool.snapshot()).
// Releases that empty_cache queued (empty_cache:defer) go back first, on this thread: those whose
// fences have completed, and, while the memory history is recorded, all of them (waiting on
// their fences): the snapshot then shows them given back, with their segment_free /
// segment_unmap entries at the end of the trace, as after PyTorch's synchronous empty_cache.
// Without the history, memory whose fence is still pending stays queued (never waited on) and
// shows as cached.
cca::SnapshotInfo torch_allocator::snapshot(MempoolId_t mempool_id, bool include_traces) {
  const bool every_pool = mempool_id.first == 0 && mempool_id.second == 0;
  finish_releases_for_snapshot(mempool_id);
  cca::SnapshotInfo out;
  std::unordered_map<void*, live_block> live;
  if (history_enabled_.load()) {
    std::lock_guard<std::mutex> lock(history_mu_);
    live = live_;
  }
  struct source {
    streamsafe::caching_allocator* alloc = nullptr;
    int device = 0;
    MempoolId_t owner{0, 0};  // an instance's pool; {0, 0}: the main allocator (by tag)
    bool instance = false;
  };
  // CUDA graph pools: streamsafe names a graph pool's segments by the pool's first graph.
  std::unordered_map<std::uint64_t, MempoolId_t> graph_pools;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (const auto& [id, pool] : pools_)
      for (std::uint64_t g : pool.graphs) graph_pools[g] = id;
    for (const capture_state& c : captures_) graph_pools[c.graph] = c.pool;
  }
  std::vector<source> sources;
  for (int d = 0; d < ss_->device_count(); ++d)
    if (streamsafe::caching_allocator* a = ss_->find_device_allocator(d))
      sources.push_back({a, d, {0, 0}, false});
  for (const std::shared_ptr<pool_instance>& inst : instances()) {
    if (!every_pool && inst->id != mempool_id) continue;
    if (streamsafe::caching_allocator* a = inst->alloc->find_device_allocator(inst->device))
      sources.push_back({a, inst->device, inst->id, true});
  }
  for (const source& src : sources) {
    const int d = src.device;
    const streamsafe::memory_snapshot snap = src.alloc->snapshot();
    for (const auto& seg : snap.segments) {
      MempoolId_t owner = src.instance ? src.owner : pool_of_tag(seg.tag);
      if (!src.instance && seg.graph_pool != 0) {
        auto g = graph_pools.find(seg.graph_pool);
        if (g != graph_pools.end()) owner = g->second;
      }
      if (!every_pool && owner != mempool_id) continue;
      // One SegmentInfo per run of mapped blocks (an expandable segment's unmapped address
      // space is not memory; PyTorch's snapshot shows mapped ranges only).
      cda::SegmentInfo cur;
      bool open = false;
      bool prev_free = false;  // the last block of cur is free (inactive)
      auto close = [&] {
        if (open && cur.total_size > 0) out.segments.push_back(std::move(cur));
        cur = cda::SegmentInfo();
        open = false;
      };
      for (const auto& b : seg.blocks) {
        if (b.state == streamsafe::snapshot_block_state::unmapped) {
          close();
          continue;
        }
        if (!open) {
          cur.device = static_cast<c10::DeviceIndex>(d);
          cur.address = b.address;
          cur.stream = reinterpret_cast<void*>(seg.stream);
          cur.is_large = seg.pool == streamsafe::snapshot_pool::large;
          cur.is_expandable = seg.expandable;
          cur.owner_private_pool_id = owner;
          open = true;
        }
        const bool free_block = b.state == streamsafe::snapshot_block_state::inactive;
        if (free_block && prev_free && !cur.blocks.empty()) {
          // Free neighbours are one block, as in PyTorch's allocator (streamsafe parks some
          // freed blocks unmerged in its quick cache).
          cur.blocks.back().size += b.size_bytes;
          cur.total_size += b.size_bytes;
          continue;
        }
        prev_free = free_block;
        cda::BlockInfo bi;
        bi.size = b.size_bytes;
        bi.requested_size = b.requested_bytes;
        bi.allocated = b.state == streamsafe::snapshot_block_state::active;
        bi.active = bi.allocated || b.state == streamsafe::snapshot_block_state::pending_free;
        if (bi.allocated) {
          auto it = live.find(reinterpret_cast<void*>(b.address));
          if (it != live.end()) bi.context_when_allocated = it->second.context;
        }
        cur.total_size += b.size_bytes;
        cur.requested_size += b.requested_bytes;
        if (bi.allocated) cur.allocated_size += b.size_bytes;
        if (bi.active) cur.active_size += b.size_bytes;
        cur.blocks.push_back(std::move(bi));
      }
      close();
    }
  }
  if (include_traces) {
    std::lock_guard<std::mutex> lock(history_mu_);
    int n = 0;
    for (int d = 0; d < max_devices; ++d)
      if (!traces_[static_cast<std::size_t>(d)].empty()) n = d + 1;
    n = std::max(n, ss_->device_count());
    out.device_traces.resize(static_cast<std::size_t>(n));
    for (int d = 0; d < n && d < max_devices; ++d) {
      const auto& ring = traces_[static_cast<std::size_t>(d)];
      out.device_traces[static_cast<std::size_t>(d)].assign(ring.begin(), ring.end());
    }
    out.external_annotations.assign(annotations_.begin(), annotations_.end());
  }
  auto& m = out.config_metadata;
  const streamsafe::options now = ss_->config();  // with _set_allocator_settings' changes
  m.garbage_collection_threshold = now.garbage_collection_threshold;
  m.max_split_size = now.max_split_size_bytes ? now.max_split_size_bytes : SIZE_MAX;
  m.pinned_num_register_threads = 1;
  m.expandable_segments = options_.backend == streamsafe::backend_kind::expandable;
  m.release_lock_on_malloc = false;
  m.pinned_use_host_register = false;
  m.graph_capture_record_stream_reuse = now.graph_capture_record_stream_reuse;
  // PyTorch's settings string, as PyTorch's allocator reports it ("PYTORCH_CUDA_ALLOC_CONF");
  // streamsafe's own options are streamsafe.torch.config().
  m.last_allocator_settings = torch_settings_text();
  return out;
}

// CUDA graphs. PyTorch (CUDAGraph::capture_begin) calls beginAllocateToPool on the thread and
// current stream that will capture, just before cudaStreamBeginCapture, with a filter that
// matches streams capturing into this graph; torch.cuda.use_mem_pool (and cudagraph trees'
// warm-up) call it with a filter on the calling thread or stream, outside any capture. The
// first is streamsafe's notify_capture_begin; the second needs a pool that is not a graph's
// and is refused by name.
}  // namespace streamsafe::torch_ext
