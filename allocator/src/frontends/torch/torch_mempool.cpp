// streamsafe PyTorch extension: torch.cuda.MemPool outside a CUDA graph capture.
//
// use_mem_pool(pool) (and cudagraph trees' beginAllocateCurrentThreadToPool / CurrentStreamToPool)
// opens a route: PyTorch's filter picks the allocations (the calling thread's, or one stream's);
// the innermost route that matches wins. A pool a CUDA graph was captured into is streamsafe's
// private pool of that graph (the core's begin_allocate_to_graph_pool, opened in torch_pools.cpp):
// cudagraph trees' allocations between captures share its segments and its checkpoint. Any other
// MemPool without an allocator of its own is a streamsafe tag ("torch.mempool.<a>.<b>"): its memory
// comes from segments of its own (core/sleep.hpp), so that MemPool.snapshot(), empty_cache of the
// pool and its statistics see only it. A MemPool with its own allocator (a CUDAPluggableAllocator)
// gets a streamsafe allocator of its own whose segments come from that allocator
// (pluggable_backend), as PyTorch's pool asks its allocator for segments; the per-process memory
// cap counts them with the device's other memory. Safety is streamsafe's everywhere: a pool's
// memory is released behind the same fences. pools_mu_ is held across streamsafe calls that never
// call back into this object (owner_device, stats), never across an allocation, a free or a
// release.
#include "extension_allocator.hpp"

namespace streamsafe::torch_ext {

namespace {

bool is_default_pool(MempoolId_t id) { return id.first == 0 && id.second == 0; }

void add_stat(streamsafe::stat& to, const streamsafe::stat& from) {
  to.current += from.current;
  to.peak += from.peak;  // an upper bound: the parts may peak at different times
  to.allocated += from.allocated;
  to.freed += from.freed;
}

}  // namespace

// ---- pluggable_backend ------------------------------------------------------------------------

void* pluggable_backend::allocate_segment(std::size_t size_bytes) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device()));
  try {
    return allocator_->raw_alloc(size_bytes);
  } catch (const std::exception&) {
    (void)cudaGetLastError();
    return nullptr;  // the pool's allocator is out of memory: streamsafe's OOM path decides
  }
}

void pluggable_backend::free_segment(void* base, std::size_t /*size_bytes*/) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device()));
  allocator_->raw_delete(base);
}

// ---- pools --------------------------------------------------------------------------------------

std::shared_ptr<torch_allocator::pool_instance> torch_allocator::make_instance(
    MempoolId_t id, int device, std::shared_ptr<cca::CUDAAllocator> allocator) {
  auto inst = std::make_shared<pool_instance>();
  inst->id = id;
  inst->device = device;
  inst->allocator = allocator;
  // The pool's allocator's segments are whole allocations (no address space to map into);
  // released at once on empty_cache (PyTorch calls the pool allocator's free there).
  streamsafe::options o = options_;
  streamsafe::runtime_options::of(ss_->config()).apply_to(o);  // _set_allocator_settings
  o.backend = streamsafe::backend_kind::cuda_malloc;
  o.empty_cache = streamsafe::empty_cache_mode::wait;
  o.release_worker = streamsafe::release_worker_mode::off;
  streamsafe::cuda::platform p = streamsafe::cuda::platform::cuda();
  auto inner = p.make_backend;
  p.make_backend = [inner, allocator, this](
                       int d, const streamsafe::options& opts) -> std::unique_ptr<device_backend> {
    return std::make_unique<limited_backend>(
        std::make_unique<pluggable_backend>(inner(d, opts), allocator),
        &limit_bytes_[static_cast<std::size_t>(d)], &backed_bytes_[static_cast<std::size_t>(d)],
        this);
  };
  inst->alloc = std::make_unique<streamsafe::cuda::allocator>(o, std::move(p));
  return inst;
}

void torch_allocator::createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                                         std::shared_ptr<cca::CUDAAllocator> allocator) {
  if (allocator.get() == this) allocator.reset();  // streamsafe itself: an ordinary pool
  std::shared_ptr<pool_instance> inst;
  if (allocator) inst = make_instance(mempool_id, device, allocator);
  std::lock_guard<std::mutex> lock(pools_mu_);
  pool_state& pool = pools_[mempool_id];
  pool.device = device;
  ++pool.use_count;
  if (inst && !pool.instance) {
    pool.allocator = allocator;
    pool.instance = inst;
    // Settings given between make_instance and here (apply_torch_settings updates ss_ before
    // it walks instances_ under this lock).
    inst->alloc->set_runtime_options(streamsafe::runtime_options::of(ss_->config()));
    instances_.push_back(inst);
    n_instances_.store(static_cast<int>(instances_.size()), std::memory_order_release);
  }
}

void torch_allocator::setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t mempool_id,
                                  bool use_on_oom) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  auto it = pools_.find(mempool_id);
  if (it == pools_.end()) return;  // ~MemPool after the pool's last user let go
  it->second.use_on_oom = use_on_oom;
}

void torch_allocator::setNoSplit(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/) {
  TORCH_CHECK(false,
              "streamsafe: MemPool(no_split=True) is not supported: streamsafe's pools split "
              "blocks by its own rules (max_split_size_mb applies to every pool)");
}

// The pool an allocation goes to: the innermost route whose filter takes it, else the pool of a
// capture underway on the stream (streamsafe's capture pool serves it; recorded here so that
// checkPoolLiveAllocations sees the pool's blocks).
torch_allocator::pool_route_choice torch_allocator::pick_route(int device, cudaStream_t stream) {
  pool_route_choice c;
  std::vector<capture_state> on_device;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
      if (it->device != device || !it->filter || !it->filter(stream)) continue;
      c.tag = it->tag;
      c.instance = it->instance;
      c.pool = it->pool;
      c.matched = true;
      return c;
    }
    for (const capture_state& cap : captures_) {
      if (cap.device != device) continue;
      if (cap.stream == stream) {
        c.pool = cap.pool;
        c.matched = true;
        return c;
      }
      on_device.push_back(cap);
    }
  }
  if (on_device.size() == 1) {  // a side stream joined into the one capture on this device
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
      (void)cudaGetLastError();
    } else if (status == cudaStreamCaptureStatusActive) {
      c.pool = on_device.front().pool;
      c.matched = true;
    }
  }
  return c;
}

void torch_allocator::note_pool_live(void* p, MempoolId_t pool, int device) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  pool_live_[p] = {pool, device};
  n_pool_live_.store(static_cast<int>(pool_live_.size()), std::memory_order_release);
}

void torch_allocator::forget_pool_live(void* p) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  pool_live_.erase(p);
  n_pool_live_.store(static_cast<int>(pool_live_.size()), std::memory_order_release);
}

// The pool's memory and the device's other memory share one cap (set_per_process_memory_fraction)
// and one device: before an allocation into the pool runs out of memory, the cache of the
// device's main allocator goes back, waited for (PyTorch's out-of-memory path releases the
// default pools' cache for an allocation into a private pool too), and the pool tries again.
void* torch_allocator::instance_malloc(pool_instance& inst, std::size_t n, c10::DeviceIndex device,
                                       cudaStream_t stream) {
  for (bool retried = false;; retried = true) {
    try {
      return inst.alloc->allocate(n, device, stream);
    } catch (const std::bad_alloc& e) {
      if (!retried && release_main_cache(device)) continue;
      out_of_memory(n, device, stream, e.what());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "streamsafe: allocation of ", n, " bytes in the memory pool (",
                  inst.id.first, ", ", inst.id.second, ") of allocator ",
                  inst.allocator ? inst.allocator->name() : std::string("?"),
                  " failed: ", e.what());
    }
  }
}

bool torch_allocator::release_main_cache(c10::DeviceIndex device) {
  streamsafe::caching_allocator* a = ss_->find_device_allocator(device);
  if (!a) return false;
  const std::size_t before = backed_bytes(device);
  guarded("empty_cache", [&] {
    (void)a->empty_cache(streamsafe::empty_cache_mode::wait);
    (void)a->wait_for_release_worker_idle(std::chrono::seconds(1));  // its release in flight
  });
  return backed_bytes(device) < before;
}

// PyTorch: an allocation that found no memory tries the pools made with use_on_oom=True, for a
// free block they have cached (PyTorch's get_free_block on the pool: no new memory, and a pool
// that cannot serve it keeps its cache). Pools without an allocator of their own are streamsafe
// memory, already given back and retried by streamsafe's out-of-memory path; a pool with its own
// allocator is tried here.
void* torch_allocator::use_on_oom_malloc(std::size_t n, c10::DeviceIndex device,
                                         cudaStream_t stream) {
  std::vector<std::shared_ptr<pool_instance>> candidates;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (auto& [id, pool] : pools_) {
      if (pool.use_on_oom && pool.instance && pool.device == device)
        candidates.push_back(pool.instance);
    }
  }
  const streamsafe::stream_handle s = streamsafe::cuda::to_stream_handle(stream);
  for (const auto& inst : candidates) {
    streamsafe::caching_allocator* a = inst->alloc->find_device_allocator(device);
    if (!a) continue;  // the pool has no memory on this device
    try {
      if (void* p = a->allocate_cached(n, s)) return p;
    } catch (const std::exception&) {
      (void)cudaGetLastError();
    }
  }
  return nullptr;
}

std::shared_ptr<torch_allocator::pool_instance> torch_allocator::instance_of(void* ptr) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  for (const auto& inst : instances_) {
    if (inst->alloc->owner_device(ptr) >= 0) return inst;
  }
  return nullptr;
}

std::vector<std::shared_ptr<torch_allocator::pool_instance>> torch_allocator::instances() {
  if (n_instances_.load(std::memory_order_acquire) == 0) return {};
  std::lock_guard<std::mutex> lock(pools_mu_);
  return instances_;
}

void torch_allocator::finish_ready_releases(streamsafe::caching_allocator* a, const char* what) {
  if (!a) return;
  try {
    (void)a->reclaim();
  } catch (const std::exception& e) {
    // A failed driver call leaves the memory queued and counted (nothing lost); the read goes on.
    TORCH_WARN("streamsafe: ", what, ": finishing releases: ", e.what());
  }
}

namespace {
// Bytes queued for release or being given back (pending_release_bytes), from the statistics.
bool releases_queued(const streamsafe::statistics& s) {
  return s.release_queued_bytes + s.release_worker_bytes != 0;
}
}  // namespace

streamsafe::statistics torch_allocator::device_stats(c10::DeviceIndex device) {
  // The common case (nothing queued) reads each allocator's statistics once, as before.
  streamsafe::statistics s = ss_->stats(device);
  if (releases_queued(s)) {
    finish_ready_releases(ss_->find_device_allocator(device), "memory_stats");
    s = ss_->stats(device);
  }
  for (const auto& inst : instances()) {
    if (inst->device != device) continue;
    streamsafe::statistics x = inst->alloc->stats(device);
    if (releases_queued(x)) {
      finish_ready_releases(inst->alloc->find_device_allocator(device), "memory_stats");
      x = inst->alloc->stats(device);
    }
    // Every pool, then each kind (small_pool, large_pool).
    for (auto [sk, xk] :
         {std::pair<streamsafe::pool_statistics*, const streamsafe::pool_statistics*>{&s, &x},
          {&s.small_pool, &x.small_pool},
          {&s.large_pool, &x.large_pool}}) {
      for (auto [to, from] :
           {std::pair{&sk->allocation, &xk->allocation}, std::pair{&sk->segment, &xk->segment},
            std::pair{&sk->active, &xk->active},
            std::pair{&sk->allocated_bytes, &xk->allocated_bytes},
            std::pair{&sk->reserved_bytes, &xk->reserved_bytes},
            std::pair{&sk->active_bytes, &xk->active_bytes},
            std::pair{&sk->inactive_split_bytes, &xk->inactive_split_bytes},
            std::pair{&sk->requested_bytes, &xk->requested_bytes}})
        add_stat(*to, *from);
    }
    s.num_alloc_retries += x.num_alloc_retries;
    s.num_ooms += x.num_ooms;
    s.num_device_alloc += x.num_device_alloc;
    s.num_device_free += x.num_device_free;
  }
  return s;
}

// PyTorch: emptyCache of the default id releases the default pools and every private pool no
// longer in use; a live MemPool keeps its cache until emptyCache is given its id (~MemPool does).
void torch_allocator::emptyCache(MempoolId_t mempool_id) {
  note_release_request();  // the metadata and stack of the releases that follow
  std::vector<std::shared_ptr<pool_instance>> release_instances;
  std::set<std::string> keep;  // tags of MemPools in use
  std::string tag;
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    if (is_default_pool(mempool_id)) {
      for (auto& [id, pool] : pools_)
        if (pool.use_count > 0) keep.insert(pool_tag(id));
      for (const auto& inst : instances_)
        if (!inst->in_use) release_instances.push_back(inst);
    } else {
      auto it = pools_.find(mempool_id);
      if (it != pools_.end() && it->second.instance) {
        release_instances.push_back(it->second.instance);
      } else {
        for (const auto& inst : instances_)
          if (inst->id == mempool_id) release_instances.push_back(inst);
      }
      known = it != pools_.end();
      tag = pool_tag(mempool_id);
    }
  }
  if (is_default_pool(mempool_id)) {
    if (keep.empty()) {
      guarded("empty_cache", [&] { ss_->empty_cache(); });
    } else {
      // Untagged memory, then every tag but the live MemPools' (streamsafe.torch.tag's too).
      std::vector<std::string> tags;
      for (streamsafe::tag_info& t : streamsafe::list_tags()) {
        if (!keep.count(t.name)) tags.push_back(std::move(t.name));
      }
      guarded("empty_cache", [&] {
        for (int d = 0; d < ss_->device_count(); ++d) {
          streamsafe::caching_allocator* a = ss_->find_device_allocator(d);
          if (!a) continue;
          a->empty_cache_untagged();
          for (const std::string& t : tags) a->empty_cache(t);
        }
      });
    }
  } else if (known || release_instances.empty()) {
    guarded("empty_cache", [&] { ss_->empty_cache(tag); });
  }
  for (const auto& inst : release_instances)
    guarded("empty_cache", [&] { inst->alloc->empty_cache(); });
  // A pool's instance that is no longer used and holds nothing is dropped (its allocator too).
  std::vector<std::shared_ptr<pool_instance>> dropped;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (auto it = instances_.begin(); it != instances_.end();) {
      const pool_instance& inst = **it;
      const bool empty = !inst.in_use &&
                         inst.alloc->stats(inst.device).reserved_bytes.current == 0 &&
                         inst.alloc->stats(inst.device).allocated_bytes.current == 0;
      if (empty) {
        dropped.push_back(*it);
        it = instances_.erase(it);
      } else {
        ++it;
      }
    }
    n_instances_.store(static_cast<int>(instances_.size()), std::memory_order_release);
  }
}

// cudagraph trees: the blocks of the pool that are allocated now must be exactly the expected
// ones. The pool's blocks are those allocated into it (a capture into it, a route to it, its
// allocator's) and not yet freed.
bool torch_allocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  std::size_t live = 0;
  std::lock_guard<std::mutex> lock(pools_mu_);
  for (const auto& [ptr, where] : pool_live_) {
    if (where.first != mempool_id || where.second != device) continue;
    if (!expected_live_allocations.count(ptr)) return false;
    ++live;
  }
  return live == expected_live_allocations.size();
}

// ---- caching_allocator_enable(False) -----------------------------------------------------------

void* torch_allocator::uncached_malloc(std::size_t n, c10::DeviceIndex device) {
  void* p = nullptr;
  {
    c10::cuda::CUDAGuard guard(device);
    const cudaError_t err = cudaMalloc(&p, n);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      out_of_memory(n, device, nullptr,
                    "cudaMalloc failed with the caching allocator disabled "
                    "(caching_allocator_enable(False))");
    }
    C10_CUDA_CHECK(err);
  }
  std::lock_guard<std::mutex> lock(uncached_mu_);
  uncached_[p] = device;
  n_uncached_.store(static_cast<int>(uncached_.size()), std::memory_order_release);
  return p;
}

bool torch_allocator::uncached_free(void* ptr) {
  int device = 0;
  {
    std::lock_guard<std::mutex> lock(uncached_mu_);
    auto it = uncached_.find(ptr);
    if (it == uncached_.end()) return false;
    device = it->second;
    uncached_.erase(it);
    n_uncached_.store(static_cast<int>(uncached_.size()), std::memory_order_release);
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cudaFree(ptr));  // synchronises the device, as PyTorch's uncached path does
  return true;
}

}  // namespace streamsafe::torch_ext
