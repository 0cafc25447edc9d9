// streamsafe: the simulated device: construction, streams and work, CUDA graph capture and the
// clock (device_model.hpp holds the state, its invariants and its lock).
#include "device_model.hpp"
#include "host_view.hpp"

#include <streamsafe/core/errors.hpp>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace streamsafe::sim {

const char* to_string(fault_kind kind) noexcept {
  switch (kind) {
    case fault_kind::release_under_pending_work: return "release_under_pending_work";
    case fault_kind::cross_stream_race: return "cross_stream_race";
    case fault_kind::access_unmapped: return "access_unmapped";
    case fault_kind::capture_violation: return "capture_violation";
    case fault_kind::access_mismatch: return "access_mismatch";
  }
  return "unknown_fault";
}

// ---- construction ---------------------------------------------------------------------

simulated_device::simulated_device(device_config config)
    : impl_(std::make_unique<impl>(std::move(config))) {}

simulated_device::~simulated_device() = default;

// ---- streams and work -----------------------------------------------------------------

stream_handle simulated_device::create_stream() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_handle handle = 0;
  if (d.reuse_handles_ && !d.destroyed_handles_.empty()) {
    handle = *d.destroyed_handles_.begin();
    d.destroyed_handles_.erase(d.destroyed_handles_.begin());
  } else {
    handle = d.next_stream_handle_++;
  }
  const std::uint64_t uid = d.next_stream_uid_++;
  stream_state state;
  state.handle = handle;
  d.streams_.emplace(uid, std::move(state));
  d.handles_[handle] = uid;
  return handle;
}

void simulated_device::destroy_stream(stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (stream == 0)
    d.fail("destroy_stream",
           "stream 0 (the legacy default stream) cannot be "
           "destroyed");
  stream_state& state = d.live_stream(stream, "destroy_stream");
  if (state.capture != 0)
    d.fail("destroy_stream", "stream " + std::to_string(stream) + " is capturing a graph");
  state.destroyed = true;
  d.handles_.erase(stream);
  d.destroyed_handles_.insert(stream);
  d.settle();  // drops the stream's state now if its queue is empty
}

void simulated_device::set_reuse_stream_handles(bool reuse) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->reuse_handles_ = reuse;
}

std::uint64_t simulated_device::launch(stream_handle stream, std::uint64_t duration_us,
                                       std::vector<range> ranges, std::string label) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_state& state = d.live_stream(stream, "launch");
  if (state.capture != 0) {
    d.graphs_.at(state.capture)
        .nodes.push_back(graph_node{duration_us, std::move(ranges), std::move(label)});
    ++state.capture_order[d.handles_.at(stream)];
    return 0;
  }
  return d.launch_locked(stream, duration_us, std::move(ranges), std::move(label));
}

std::uint64_t simulated_device::impl::launch_locked(stream_handle stream, std::uint64_t duration_us,
                                                    std::vector<range> ranges, std::string label) {
  impl& d = *this;
  stream_state& state = d.live_stream(stream, "launch");
  const std::uint64_t uid = d.handles_.at(stream);

  work_item item;
  item.kind = item_kind::kernel;
  item.duration_us = duration_us;
  item.ranges = std::move(ranges);
  item.label = std::move(label);
  work_item& added = d.enqueue(state, uid, std::move(item));
  ++d.counters_.launches;

  // cross_stream_race: pending work on another stream touching the same bytes, one of the two
  // a write, that this stream's clock does not order before the new kernel.
  std::vector<range> checked = added.ranges;  // and the same memory at other addresses
  for (const range& r : added.ranges) {
    for (const range& a : d.aliases_of(r)) checked.push_back(a);
  }
  // The pending items of other streams that this stream's clock does not order before the new
  // kernel: in each stream's queue (enqueue order, so rising seq) a suffix. Visited in id order,
  // as a walk of pending_ would, so that faults are recorded in the same order.
  std::vector<std::uint64_t> unordered;
  for (const auto& [other_uid, other_stream] : d.streams_) {
    if (other_uid == uid) continue;
    const std::uint64_t known = clock_of(state.clock, other_uid);
    for (auto it = other_stream.queue.rbegin(); it != other_stream.queue.rend(); ++it) {
      if (d.pending_.at(*it).seq <= known) break;
      unordered.push_back(*it);
    }
  }
  std::sort(unordered.begin(), unordered.end());
  for (const std::uint64_t other_id : unordered) {
    const work_item& other = d.pending_.at(other_id);
    for (const range& mine : checked) {
      const range* hit = nullptr;
      for (const range& theirs : other.ranges) {
        if ((mine.mode == access::write || theirs.mode == access::write) &&
            overlaps(mine.begin, mine.size_bytes, theirs.begin, theirs.size_bytes)) {
          hit = &theirs;
          break;
        }
      }
      if (hit == nullptr) continue;
      d.record_fault(fault_kind::cross_stream_race,
                     d.describe_item(added) + " " + describe_range(mine) + " while " +
                         d.describe_item(other) + (other.started ? " (running) " : " (queued) ") +
                         describe_range(*hit) + " is pending and not ordered before it");
      break;
    }
  }

  // access_unmapped: bytes not backed by a live segment or a mapped chunk.
  for (const range& r : added.ranges) {
    if (r.size_bytes == 0) continue;
    if (const auto bad = d.first_unbacked(r.begin, r.size_bytes)) {
      d.record_fault(fault_kind::access_unmapped,
                     d.describe_item(added) + " " + describe_range(r) + ": " + hex(*bad) +
                         " is not backed by a live segment or a mapped chunk");
    }
  }

  const std::uint64_t id = added.id;
  d.settle();
  return id;
}

std::uint64_t simulated_device::hold(stream_handle stream, std::string label) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_state& state = d.live_stream(stream, "hold");
  if (state.capture != 0) {
    throw std::logic_error("simulated_device: hold on stream " + std::to_string(stream) +
                           ", which is capturing a graph: a captured hold is not modelled");
  }
  work_item item;
  item.kind = item_kind::hold;
  item.label = std::move(label);
  const std::uint64_t id = d.enqueue(state, d.handles_.at(stream), std::move(item)).id;
  d.settle();
  return id;
}

void simulated_device::open(std::uint64_t hold_id) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (hold_id == 0 || hold_id >= d.next_item_id_) {
    throw std::invalid_argument("simulated_device: open: unknown work item " +
                                std::to_string(hold_id));
  }
  auto it = d.pending_.find(hold_id);
  if (it == d.pending_.end()) return;  // already completed: opening twice is harmless
  if (it->second.kind != item_kind::hold) {
    throw std::invalid_argument("simulated_device: open: work item " + std::to_string(hold_id) +
                                " is not a hold");
  }
  it->second.opened = true;
  d.settle();
}

bool simulated_device::completed(std::uint64_t work_id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  if (work_id == 0 || work_id >= impl_->next_item_id_) {
    throw std::invalid_argument("simulated_device: completed: unknown work item " +
                                std::to_string(work_id));
  }
  return impl_->pending_.count(work_id) == 0;
}

bool simulated_device::stream_idle(stream_handle stream) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return std::as_const(*impl_).live_stream(stream, "stream_idle").queue.empty();
}

// ---- CUDA graph capture -----------------------------------------------------------------

void simulated_device::begin_capture(stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (stream == 0) d.fail("begin_capture", "the legacy default stream (0) cannot capture");
  stream_state& state = d.live_stream(stream, "begin_capture");
  if (state.capture != 0) {
    d.fail("begin_capture", "stream " + std::to_string(stream) + " is already capturing graph " +
                                std::to_string(state.capture));
  }
  const std::uint64_t id = d.next_graph_id_++;
  graph_state g;
  g.stream = stream;
  d.graphs_.emplace(id, std::move(g));
  state.capture = id;
  ++d.capturing_streams_;
}

std::uint64_t simulated_device::end_capture(stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  stream_state& state = d.live_stream(stream, "end_capture");
  if (state.capture == 0)
    d.fail("end_capture", "stream " + std::to_string(stream) + " is not capturing");
  const std::uint64_t id = state.capture;
  graph_state& g = d.graphs_.at(id);
  if (g.stream != stream) {
    d.fail("end_capture", "stream " + std::to_string(stream) + " joined the capture of graph " +
                              std::to_string(id) + " begun on stream " + std::to_string(g.stream) +
                              ", which ends it (cudaErrorStreamCaptureUnmatched)");
  }
  for (auto& [uid, st] : d.streams_) {  // the capturing stream and every stream that joined
    if (st.capture != id) continue;
    st.capture = 0;
    st.capture_order.clear();
    --d.capturing_streams_;
  }
  g.capturing = false;
  if (g.invalidated) {
    const std::string why = g.invalidated_by;
    d.graphs_.erase(id);
    d.fail("end_capture", "the capture of graph " + std::to_string(id) + " on stream " +
                              std::to_string(stream) + " was invalidated by " + why +
                              " (cudaErrorStreamCaptureInvalidated)");
  }
  return id;
}

bool simulated_device::capturing(stream_handle stream) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return std::as_const(*impl_).live_stream(stream, "capturing").capture != 0;
}

std::uint64_t simulated_device::launch_graph(std::uint64_t graph, stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  auto it = d.graphs_.find(graph);
  if (it == d.graphs_.end() || it->second.capturing) {
    throw std::invalid_argument("simulated_device: launch_graph: no captured graph " +
                                std::to_string(graph));
  }
  if (d.live_stream(stream, "launch_graph").capture != 0) {
    d.fail("launch_graph", "stream " + std::to_string(stream) + " is capturing");
  }
  std::uint64_t last = 0;
  for (const graph_node& node : it->second.nodes) {
    last = d.launch_locked(stream, node.duration_us, node.ranges,
                           node.label + " (graph " + std::to_string(graph) + ")");
  }
  ++d.counters_.graph_launches;
  return last;
}

std::size_t simulated_device::graph_kernel_count(std::uint64_t graph) const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  auto it = impl_->graphs_.find(graph);
  if (it == impl_->graphs_.end()) {
    throw std::invalid_argument("simulated_device: graph_kernel_count: no graph " +
                                std::to_string(graph));
  }
  return it->second.nodes.size();
}

bool simulated_device::stream_is_capturing(stream_handle stream) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  ++d.counters_.capture_queries;
  auto it = d.handles_.find(stream);
  return it != d.handles_.end() && d.streams_.at(it->second).capture != 0;
}

std::uint64_t simulated_device::capture_id(stream_handle stream) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  ++d.counters_.capture_queries;
  auto it = d.handles_.find(stream);
  return it == d.handles_.end() ? 0 : d.streams_.at(it->second).capture;
}

std::vector<std::uintptr_t> simulated_device::capture_position(stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  const stream_state& state = d.live_stream(stream, "capture_position");
  if (state.capture == 0) return {};
  const std::uint64_t uid = d.handles_.at(stream);
  return {static_cast<std::uintptr_t>(uid),
          static_cast<std::uintptr_t>(clock_of(state.capture_order, uid))};
}

bool simulated_device::capture_follows(stream_handle stream,
                                       const std::vector<std::uintptr_t>& position) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  const stream_state& state = d.live_stream(stream, "capture_follows");
  if (state.capture == 0) return false;
  for (std::size_t i = 0; i + 1 < position.size(); i += 2)
    if (clock_of(state.capture_order, position[i]) < position[i + 1]) return false;
  return true;
}

// ---- clock ------------------------------------------------------------------------------

std::uint64_t simulated_device::now_us() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->now_;
}

void simulated_device::advance(std::uint64_t duration_us) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->advance(duration_us);
}

void simulated_device::run_until_idle() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  if (!d.advance_until([&d] { return d.idle(); })) {
    throw std::logic_error("simulated_device: run_until_idle: " + d.deadlock_message("the device"));
  }
}

}  // namespace streamsafe::sim
