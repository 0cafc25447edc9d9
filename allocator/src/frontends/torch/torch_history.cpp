// streamsafe PyTorch extension: the memory history (torch.cuda.memory._record_memory_history):
// alloc / free trace entries with the Python context PyTorch's recorder gathers, segment events
// from limited_backend, and the trace trackers PyTorch attaches. history_mu_ and observers_mu_
// are leaf locks, never held across a call into streamsafe.
#include "extension_allocator.hpp"

namespace streamsafe::torch_ext {

void limited_backend::note(cda::TraceEntry::Action action, void* addr,
                           std::size_t size_bytes) noexcept {
  owner_->note_segment(action, inner().device(), addr, size_bytes);
}

void torch_allocator::note_alloc(void* p, std::size_t n, int device, cudaStream_t stream) {
  std::shared_ptr<c10::GatheredContext> ctx;
  cda::CreateContextFn recorder = nullptr;
  cda::RecordContext when = cda::RecordContext::NEVER;
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    recorder = recorder_;
    when = when_;
  }
  if (recorder && when != cda::RecordContext::NEVER) ctx = recorder();
  if (history_enabled_.load()) {
    std::lock_guard<std::mutex> lock(history_mu_);
    live_[p] = live_block{ctx, n, device, stream};
  }
  emit(cda::TraceEntry(cda::TraceEntry::ALLOC, static_cast<c10::DeviceIndex>(device),
                       reinterpret_cast<std::uintptr_t>(p), n, stream, {0, 0},
                       c10::getApproximateTime(),
                       when >= cda::RecordContext::ALLOC ? ctx : nullptr));
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
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  const auto dev = static_cast<c10::DeviceIndex>(b.device);
  emit(cda::TraceEntry(cda::TraceEntry::FREE_REQUESTED, dev, addr, b.requested, b.stream, {0, 0},
                       c10::getApproximateTime(), ctx));
  emit(cda::TraceEntry(cda::TraceEntry::FREE_COMPLETED, dev, addr, b.requested, b.stream, {0, 0},
                       c10::getApproximateTime(), ctx));
}
// Trace trackers get the entry as PyTorch's allocator gives it (approximate clock); the
// history keeps it with time_.t_ in microseconds since the epoch, as snapshot() returns it.
void torch_allocator::emit(cda::TraceEntry te) {
  if (has_trackers_.load(std::memory_order_relaxed)) {
    std::vector<cda::AllocatorTraceTracker> trackers;
    {
      std::lock_guard<std::mutex> lock(observers_mu_);
      trackers = trace_trackers_;
    }
    for (auto& t : trackers) t(te);
  }
  if (!history_enabled_.load(std::memory_order_relaxed)) return;
  te.time_.t_ = static_cast<time_t>(now_us());
  std::lock_guard<std::mutex> lock(history_mu_);
  if (skip_.count(te.action_)) return;
  if (te.device_ < 0 || te.device_ >= max_devices) return;
  auto& ring = traces_[static_cast<std::size_t>(te.device_)];
  ring.push_back(std::move(te));
  while (ring.size() > max_entries_) ring.pop_front();
}

}  // namespace streamsafe::torch_ext
