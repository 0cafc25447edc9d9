// streamsafe PyTorch extension: the out-of-memory error. Its first part is PyTorch's message,
// word for word and with PyTorch's units (code that parses "Tried to allocate 2.00 GiB. GPU 0 has
// a total capacity of ..." keeps working); then streamsafe's account of the device: memory
// cached in its pools, queued for release behind fences, freed by the host but waiting for
// other streams' work, and held by CUDA graphs' private pools, and the core's own diagnosis.
// PyTorch's count of the process's memory in use (from NVML) is left out: streamsafe does not
// link NVML.
#include "extension_allocator.hpp"

#include <iomanip>

namespace streamsafe::torch_ext {

std::string torch_format_size(std::uint64_t bytes) {
  constexpr std::uint64_t kib = 1024, mib = kib * 1024, gib = mib * 1024;
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  if (bytes <= kib) {
    os << bytes << " bytes";
  } else if (bytes <= mib) {
    os << static_cast<double>(bytes) / static_cast<double>(kib) << " KiB";
  } else if (bytes <= gib) {
    os << static_cast<double>(bytes) / static_cast<double>(mib) << " MiB";
  } else {
    os << static_cast<double>(bytes) / static_cast<double>(gib) << " GiB";
  }
  return os.str();
}

// PyTorch refuses a request of 1 EiB or more before it reaches the allocator's pools, with its
// own message (no device could hold it; the size is most likely a bug).
void torch_allocator::check_request_size(std::size_t n) {
  constexpr std::size_t one_exa_bytes = std::size_t{1} << 60;
  TORCH_CHECK_WITH(OutOfMemoryError, n < one_exa_bytes,
                   "CUDA out of memory. Tried to allocate more than 1EB memory.");
}

namespace {

// What the device's pools hold, for the message (one snapshot, taken after the failure).
struct pool_account {
  std::size_t graph_reserved = 0;  // mapped bytes of segments in CUDA graphs' private pools
  std::size_t graph_free = 0;      // of which cached free (PyTorch: "allocated in private pools")
};

pool_account account_of(const streamsafe::memory_snapshot& snap) {
  pool_account a;
  for (const streamsafe::segment_snapshot& seg : snap.segments) {
    if (seg.graph_pool == 0) continue;
    a.graph_reserved += seg.mapped_bytes;
    a.graph_free += seg.bytes_in(streamsafe::snapshot_block_state::inactive);
  }
  return a;
}

}  // namespace

void torch_allocator::out_of_memory(std::size_t n, c10::DeviceIndex device, cudaStream_t stream,
                                    const char* what) {
  std::size_t free_bytes = 0, total_bytes = 0;
  {
    c10::cuda::CUDAGuard guard(device);
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
  }
  streamsafe::statistics s;
  pool_account pools;
  std::size_t queued = 0;
  if (streamsafe::caching_allocator* a = ss_->find_device_allocator(device)) {
    const streamsafe::memory_snapshot snap = a->snapshot();
    s = snap.stats;
    pools = account_of(snap);
    queued = a->pending_release_bytes();
  } else {
    s = ss_->stats(device);
  }
  if (history_enabled_.load() || has_trackers_.load()) {
    emit(cda::TraceEntry(cda::TraceEntry::OOM, device, free_bytes, n, stream, {0, 0},
                         c10::getApproximateTime()));
  }
  std::vector<cca::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(observers_mu_);
    observers = oom_observers_;
  }
  const std::size_t limit = limit_bytes_[static_cast<std::size_t>(device)].load();
  for (auto& o : observers) o(device, n, limit ? limit : total_bytes, free_bytes);
  c10::reportOutOfMemoryToProfiler(
      static_cast<int64_t>(n), static_cast<size_t>(s.allocated_bytes.current),
      static_cast<size_t>(s.reserved_bytes.current), c10::Device(c10::DeviceType::CUDA, device));

  const auto allocated = static_cast<std::uint64_t>(
      std::max<std::int64_t>(0, s.allocated_bytes.current));
  const auto reserved = static_cast<std::uint64_t>(
      std::max<std::int64_t>(0, s.reserved_bytes.current));
  const auto active = static_cast<std::uint64_t>(std::max<std::int64_t>(0, s.active_bytes.current));
  const std::uint64_t in_private = pools.graph_free;
  const std::uint64_t unallocated = reserved > allocated + in_private
                                        ? reserved - allocated - in_private
                                        : 0;
  const std::string allowed = limit ? torch_format_size(limit) + " allowed; " : std::string();
  const std::string private_pools = in_private
                                        ? "with " + torch_format_size(in_private) +
                                              " allocated in private pools (e.g., CUDA Graphs), "
                                        : std::string();
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                   torch_format_size(n), ". GPU ", static_cast<int>(device),
                   " has a total capacity of ", torch_format_size(total_bytes), " of which ",
                   torch_format_size(free_bytes), " is free. ", allowed, "Of the allocated memory ",
                   torch_format_size(allocated + in_private), " is allocated by PyTorch, ",
                   private_pools, "and ", torch_format_size(unallocated),
                   " is reserved by PyTorch but unallocated. streamsafe: ",
                   torch_format_size(reserved > allocated ? reserved - allocated : 0),
                   " cached (reserved, not allocated), ", torch_format_size(queued),
                   " queued for release behind fences, ",
                   torch_format_size(active > allocated ? active - allocated : 0),
                   " freed and waiting for other streams' work, ",
                   torch_format_size(pools.graph_reserved), " held by CUDA graphs' private pools (",
                   torch_format_size(pools.graph_free), " of it free). ", what);
}

}  // namespace streamsafe::torch_ext
