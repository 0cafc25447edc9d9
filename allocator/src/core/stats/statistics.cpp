// streamsafe core: text form of the statistics. A pure function of its argument: no state, no
// lock (caching_allocator::stats takes the locks and returns a copy).
#include <streamsafe/core/statistics.hpp>

#include <sstream>

namespace streamsafe {

std::string statistics::to_string() const {
  std::ostringstream os;
  for_each_counter(*this, [&](const std::string& key, std::int64_t value) {
    os << key << ": " << value << '\n';
  });
  os << "num_alloc_retries: " << num_alloc_retries << '\n'
     << "num_ooms: " << num_ooms << '\n'
     << "num_device_alloc: " << num_device_alloc << '\n'
     << "num_device_free: " << num_device_free << '\n'
     << "num_sync_all_streams: " << num_sync_all_streams << '\n'
     << "events_recorded: " << events_recorded << '\n'
     << "stream_waits: " << stream_waits << '\n'
     << "fence_waits: " << fence_waits << '\n'
     << "fence_wait_ns: " << fence_wait_ns << '\n'
     << "releases_deferred: " << releases_deferred << '\n'
     << "bytes_released: " << bytes_released << '\n'
     << "segments_moved: " << segments_moved << '\n'
     << "release_reclaimed_bytes: " << release_reclaimed_bytes << '\n'
     << "release_queued_bytes: " << release_queued_bytes << '\n'
     << "release_worker_bytes: " << release_worker_bytes << '\n'
     << "release_worker_releases: " << release_worker_releases << '\n';
  return os.str();
}

}  // namespace streamsafe
