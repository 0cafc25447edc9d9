// streamsafe: the simulated device's events, stream waits and synchronisation, and its faults,
// counters and failure injection (device_model.hpp: state and lock).
#include "device_model.hpp"

#include <streamsafe/core/errors.hpp>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace streamsafe::sim {

// ---- faults, counters, injection --------------------------------------------------------

std::vector<fault> simulated_device::faults() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->faults_;
}

std::size_t simulated_device::fault_count() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->faults_.size();
}

void simulated_device::clear_faults() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->faults_.clear();
}

sim::counters simulated_device::counters() const {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  return impl_->counters_;
}

void simulated_device::fail_next(call c, int count) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl_->injected_[static_cast<std::size_t>(c)] = std::max(count, 0);
}

// ---- device_backend: events and streams -------------------------------------------------

event_handle simulated_device::create_event() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::create_event);
  const event_handle event = d.next_event_handle_++;
  d.events_.emplace(event, event_state{});
  ++d.counters_.events_created;
  return event;
}

void simulated_device::destroy_event(event_handle event) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  // Pending waits keep the marker id, so destroying a recorded event is safe (as in CUDA).
  if (impl_->destroy_ipc_event(event)) return;  // an interprocess event (ipc.cpp)
  if (impl_->events_.erase(event) != 0) ++impl_->counters_.events_destroyed;
}

void simulated_device::record_event(event_handle event, stream_handle stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::record_event);
  event_state& ev = d.live_event(event, "record_event");
  stream_state& state = d.live_stream(stream, "record_event");
  if (state.capture != 0) {  // a captured event: a node of the graph, nothing runs now
    ev.recorded = false;
    ev.marker = 0;
    ev.captured = state.capture_order;  // the captured work it follows
    ev.capture = state.capture;
    ++d.counters_.events_recorded;
    return;
  }
  ev.capture = 0;
  work_item item;
  item.kind = item_kind::record;
  item.label = "event " + std::to_string(event);
  const std::uint64_t marker = d.enqueue(state, d.handles_.at(stream), std::move(item)).id;
  ev.recorded = true;
  ev.marker = marker;
  ev.captured = state.clock;  // includes the marker's own seq
  ++d.counters_.events_recorded;
  d.settle();
}

bool simulated_device::query_event(event_handle event) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::query_event);
  const event_state& ev = d.live_event(event, "query_event");
  d.check_not_capturing("query_event");
  if (ev.capture != 0) {
    d.capture_violation("query_event", "event " + std::to_string(event) +
                                           " was last recorded in a capture "
                                           "(cudaErrorCapturedEvent)");
  }
  ++d.counters_.event_queries;
  return !ev.recorded || d.pending_.count(ev.marker) == 0;
}

std::uint64_t simulated_device::impl::sync_marker(event_handle event, const char* what) {
  throw_if_injected(call::synchronize_event);
  const event_state& ev = live_event(event, what);
  check_not_capturing(what);
  if (ev.capture != 0) {
    capture_violation(what, "event " + std::to_string(event) +
                                " was last recorded in a capture (cudaErrorCapturedEvent)");
  }
  return ev.recorded ? ev.marker : 0;
}

void simulated_device::synchronize_event(event_handle event) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  const std::uint64_t marker = d.sync_marker(event, "synchronize_event");
  if (!d.advance_until([&d, marker] { return d.pending_.count(marker) == 0; })) {
    d.fail("synchronize_event", d.deadlock_message("event " + std::to_string(event)));
  }
  ++d.counters_.event_syncs;
}

bool simulated_device::synchronize_event_for(event_handle event, std::uint64_t timeout_us) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  const std::uint64_t marker = d.sync_marker(event, "synchronize_event_for");
  const std::uint64_t until = d.now_ + timeout_us;
  ++d.counters_.bounded_event_syncs;
  while (d.pending_.count(marker) != 0) {
    const auto next = d.next_finish();
    if (!next || *next > until) return false;  // a hold blocks it, or not within the timeout
    d.step_to(*next);
  }
  return true;
}

void simulated_device::stream_wait_event(stream_handle stream, event_handle event) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::stream_wait_event);
  const event_state& ev = d.live_event(event, "stream_wait_event");
  stream_state& state = d.live_stream(stream, "stream_wait_event");
  if (ev.capture != 0 && state.capture == 0 && d.graphs_.at(ev.capture).capturing) {
    // A stream outside any capture waiting on an event of a capture underway joins that capture
    // (CUDA's cross-stream capture): its launches go into the graph until the capture ends.
    state.capture = ev.capture;
    ++d.capturing_streams_;
  }
  if (ev.capture != 0 && ev.capture != state.capture) {
    d.capture_violation(
        "stream_wait_event",
        "stream " + std::to_string(stream) + " waits on event " + std::to_string(event) +
            ", captured in graph " + std::to_string(ev.capture) +
            (state.capture ? ", from another capture" : ", from outside the capture"));
  }
  if (ev.capture == 0 && state.capture != 0 && ev.recorded) {
    d.capture_violation("stream_wait_event",
                        "capturing stream " + std::to_string(stream) + " waits on event " +
                            std::to_string(event) +
                            ", recorded outside the capture (needs cudaEventWaitExternal)");
  }
  ++d.counters_.stream_waits;
  if (ev.capture != 0) {  // inside its own capture: ordering within the graph
    merge_into(state.capture_order, ev.captured);
    return;
  }
  if (!ev.recorded) return;  // waiting on a never-recorded event is a no-op, as in CUDA
  const std::uint64_t uid = d.handles_.at(stream);
  work_item item;
  item.kind = item_kind::wait;
  item.label = "wait on event " + std::to_string(event);
  item.depends_on = ev.marker;
  d.enqueue(state, uid, std::move(item));
  merge_into(state.clock, ev.captured);  // ordering is decided at enqueue time
  d.settle();
}

bool simulated_device::query_stream(stream_handle stream) { return stream_idle(stream); }

void simulated_device::synchronize_device() {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  impl& d = *impl_;
  d.throw_if_injected(call::synchronize_device);
  d.check_not_capturing("synchronize_device");
  if (!d.advance_until([&d] { return d.idle(); })) {
    d.fail("synchronize_device", d.deadlock_message("the device"));
  }
  ++d.counters_.device_syncs;
}

void simulated_device::memory_info(std::size_t& free_bytes, std::size_t& total_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex_);
  total_bytes = impl_->config_.total_bytes;
  free_bytes = total_bytes - impl_->bytes_in_use_;
}

}  // namespace streamsafe::sim
