// streamsafe PyTorch extension: the memory history (torch.cuda.memory._record_memory_history):
// alloc / free trace entries with the Python context PyTorch's recorder gathers (a free without
// a stack of its own carries its allocation's, as in PyTorch), segment events from
// limited_backend (memory an allocation brings in carries that allocation's stack), record_function
// annotations, the compile context and user metadata on every entry (a segment given back behind a
// fence carries the metadata, and with context="all" the Python stack, of the empty_cache that
// asked for it), the trace trackers PyTorch attaches, and torch.profiler's memory records.
// history_mu_ and observers_mu_ are leaf locks, never held across a call into streamsafe.
#include "extension_allocator.hpp"

namespace streamsafe::torch_ext {

void limited_backend::note(cda::TraceEntry::Action action, void* addr,
                           std::size_t size_bytes) noexcept {
  owner_->note_segment(action, inner().device(), addr, size_bytes);
}

thread_local const torch_allocator::alloc_context*
    torch_allocator::segment_context_scope::current_ = nullptr;

torch_allocator::segment_context_scope::segment_context_scope(const alloc_context* c) noexcept
    : set_(c != nullptr) {
  if (!set_) return;
  outer_ = current_;
  current_ = c;
}
torch_allocator::segment_context_scope::~segment_context_scope() {
  if (set_) current_ = outer_;
}
const torch_allocator::alloc_context* torch_allocator::segment_context_scope::current() noexcept {
  return current_;
}

torch_allocator::alloc_context torch_allocator::gather_alloc_context() {
  alloc_context c;
  cda::CreateContextFn recorder = nullptr;
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    recorder = recorder_;
    c.when = when_;
  }
  if (recorder && c.when != cda::RecordContext::NEVER) c.stack = recorder();  // no lock held
  return c;
}

void torch_allocator::note_alloc(void* p, std::size_t n, int device, cudaStream_t stream,
                                 const alloc_context& ctx) {
  if (has_release_context_.load(std::memory_order_relaxed)) forget_release_context_when_done();
  if (history_enabled_.load()) {
    std::lock_guard<std::mutex> lock(history_mu_);
    live_[p] = live_block{ctx.stack, n, device, stream};
  }
  emit(cda::TraceEntry(cda::TraceEntry::ALLOC, static_cast<c10::DeviceIndex>(device),
                       reinterpret_cast<std::uintptr_t>(p), n, stream, {0, 0},
                       c10::getApproximateTime(),
                       ctx.when >= cda::RecordContext::ALLOC ? ctx.stack : nullptr));
}
void torch_allocator::note_free(void* p) {
  live_block b;
  bool known = false;
  cda::CreateContextFn recorder = nullptr;
  cda::RecordContext when = cda::RecordContext::NEVER;
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    auto it = live_.find(p);
    if (it != live_.end()) {
      b = it->second;
      known = true;
      live_.erase(it);
    }
    recorder = recorder_;
    when = when_;
  }
  if (!known) {
    const int device = ss_->owner_device(p);
    if (device < 0) return;
    b.device = device;
    if (auto* a = ss_->find_device_allocator(device)) b.requested = a->find_block(p).size_bytes;
  }
  std::shared_ptr<c10::GatheredContext> ctx;
  if (recorder && when == cda::RecordContext::ALL) ctx = recorder();
  if (!ctx) ctx = b.context;  // PyTorch: a free without its own stack shows the allocation's
  if (when < cda::RecordContext::ALLOC) ctx = nullptr;
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  const auto dev = static_cast<c10::DeviceIndex>(b.device);
  emit(cda::TraceEntry(cda::TraceEntry::FREE_REQUESTED, dev, addr, b.requested, b.stream, {0, 0},
                       c10::getApproximateTime(), ctx));
  emit(cda::TraceEntry(cda::TraceEntry::FREE_COMPLETED, dev, addr, b.requested, b.stream, {0, 0},
                       c10::getApproximateTime(), ctx));
}
// Trace trackers get the entry as PyTorch's allocator gives it (approximate clock); the
// history keeps it with time_.t_ in microseconds since the epoch, as snapshot() returns it.
void torch_allocator::emit(cda::TraceEntry te, bool release_event) {
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    te.compile_context_ = compile_context_.empty() ? "N/A" : compile_context_.back();
    te.user_metadata_ = release_event ? release_metadata_ : user_metadata_;
    // PyTorch gathers the releasing call's stack only with context="all" and records it when
    // the entry is made with context "alloc" or "all".
    if (release_event)
      te.context_ = when_ >= cda::RecordContext::ALLOC ? release_context_ : nullptr;
  }
  if (has_trackers_.load(std::memory_order_relaxed)) {
    std::vector<cda::AllocatorTraceTracker> trackers;
    {
      std::lock_guard<std::mutex> lock(observers_mu_);
      trackers = trace_trackers_;
    }
    for (auto& t : trackers) t(te);
  }
  te.time_.t_ = static_cast<time_t>(now_us());
  std::lock_guard<std::mutex> lock(history_mu_);
  // A stack this entry or an entry leaving the ring held is dropped later, by a PyTorch thread
  // outside every lock (drain_dropped_contexts): this may be the release worker's thread, or a
  // thread inside a streamsafe call, and destroying a Python stack takes the GIL.
  const auto drop = [&](cda::TraceEntry& e) {
    if (!e.context_) return;
    dropped_contexts_.push_back(std::move(e.context_));
    has_dropped_contexts_.store(true, std::memory_order_relaxed);
  };
  if (!history_enabled_.load(std::memory_order_relaxed) || skip_.count(te.action_) ||
      te.device_ < 0 || te.device_ >= max_devices) {
    drop(te);
    return;
  }
  auto& ring = traces_[static_cast<std::size_t>(te.device_)];
  ring.push_back(std::move(te));
  while (ring.size() > max_entries_) {
    drop(ring.front());
    ring.pop_front();
  }
}

void torch_allocator::drain_dropped_contexts() {
  std::vector<std::shared_ptr<c10::GatheredContext>> dropped;
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    dropped.swap(dropped_contexts_);
    has_dropped_contexts_.store(false, std::memory_order_relaxed);
  }
  // `dropped` goes out of scope here, with no lock held: a stack's last owner takes the GIL.
}

void torch_allocator::note_release_request() {
  cda::CreateContextFn recorder = nullptr;
  cda::RecordContext when = cda::RecordContext::NEVER;
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    recorder = recorder_;
    when = when_;
  }
  std::shared_ptr<c10::GatheredContext> ctx;
  if (recorder && when == cda::RecordContext::ALL) ctx = recorder();  // not under history_mu_
  std::lock_guard<std::mutex> lock(history_mu_);
  release_metadata_ = user_metadata_;
  release_context_ = std::move(ctx);
  has_release_context_.store(release_context_ != nullptr);
}
void torch_allocator::forget_release_context_when_done() {
  std::shared_ptr<c10::GatheredContext> seen;
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    seen = release_context_;
  }
  if (!seen) return;
  std::size_t outstanding = 0;
  for (int d = 0; d < ss_->device_count(); ++d)
    if (const streamsafe::caching_allocator* a = ss_->find_device_allocator(d))
      outstanding += a->pending_release_bytes();
  for (const std::shared_ptr<pool_instance>& inst : instances())
    if (const streamsafe::caching_allocator* a = inst->alloc->find_device_allocator(inst->device))
      outstanding += a->pending_release_bytes();
  if (outstanding != 0) return;
  std::lock_guard<std::mutex> lock(history_mu_);
  if (release_context_ != seen) return;  // a later empty_cache's: its releases may be ahead
  release_context_.reset();
  has_release_context_.store(false);
}

void torch_allocator::recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
  if (!history_enabled_.load()) return;
  decltype(annotations_)::value_type entry(c10::cuda::current_device(), c10::getApproximateTime());
  for (const auto& [name, value] : md) entry.recordUserMetadata(name, value);
  entry.time_.t_ = static_cast<time_t>(now_us());  // as the trace entries: microseconds
  std::lock_guard<std::mutex> lock(history_mu_);
  annotations_.push_back(std::move(entry));
  while (annotations_.size() > max_entries_) annotations_.pop_front();
}
void torch_allocator::pushCompileContext(std::string& md) {
  std::lock_guard<std::mutex> lock(history_mu_);
  compile_context_.push_back(md);
}
void torch_allocator::popCompileContext() {
  std::lock_guard<std::mutex> lock(history_mu_);
  if (!compile_context_.empty()) compile_context_.pop_back();
}
void torch_allocator::setUserMetadata(const std::string& metadata) {
  std::lock_guard<std::mutex> lock(history_mu_);
  user_metadata_ = metadata;
}
std::string torch_allocator::getUserMetadata() {
  std::lock_guard<std::mutex> lock(history_mu_);
  return user_metadata_;
}

void torch_allocator::report_to_profiler(void* p, std::int64_t signed_size, int device) {
  const streamsafe::statistics s = ss_->stats(device);
  c10::reportMemoryUsageToProfiler(
      p, signed_size, static_cast<size_t>(s.allocated_bytes.current),
      static_cast<size_t>(s.reserved_bytes.current),
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}
void torch_allocator::report_free_to_profiler(void* p) {
  const int device = ss_->owner_device(p);
  if (device < 0) return;
  const streamsafe::caching_allocator* a = ss_->find_device_allocator(device);
  const std::size_t size = a ? a->find_block(p).size_bytes : 0;
  if (size != 0) report_to_profiler(p, -static_cast<std::int64_t>(size), device);
}

}  // namespace streamsafe::torch_ext
