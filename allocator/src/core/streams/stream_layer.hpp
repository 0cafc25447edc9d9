// streamsafe core: the stream layer of caching_allocator::impl (internal): stream states and
// keys (a handle, or a per-thread stream's key; streams.cpp), and their events: the event pool,
// cross-stream order, the pending list (events.cpp). Calls only the block layer beneath it
// (blocks/block_layer.hpp has the chain of layers).
#pragma once

#include "core/blocks/block_layer.hpp"

#include <cstddef>

namespace streamsafe::detail {

struct stream_layer : block_layer {
  using block_layer::block_layer;

  // streams.cpp
  stream_state& state_for(stream_handle stream);  // no lock held; may take mu_
  stream_state& get_or_create_stream_locked(stream_handle stream) STREAMSAFE_REQUIRES(mu_);
  stream_state& new_state_locked(stream_handle key, stream_handle handle,
                                 stream_handle cache_key = 0) STREAMSAFE_REQUIRES(mu_);
  stream_handle key_of(stream_handle stream) const;
  stream_handle record_event_on(event_handle e, stream_handle key);
  void stream_wait_on(stream_handle key, event_handle e);
  bool query_stream_of(stream_handle key);
  bool stream_capturing(stream_handle key) noexcept;
  stream_state* owner_locked(const void* ptr) STREAMSAFE_REQUIRES(mu_);
  void drop_tombstone_locked(event_handle e) STREAMSAFE_REQUIRES(mu_);
  stream_state* cached_live_state(stream_handle stream) const;  // this thread's stream cache
  // events.cpp
  event_handle get_event();  // takes the event pool's lock (a leaf)
  void put_event(event_handle e);
  event_handle get_event(stream_state& st) STREAMSAFE_REQUIRES(st.mu);  // st's cache first
  void put_event(stream_state& st, event_handle e) STREAMSAFE_REQUIRES(st.mu);
  void order_after_locked(stream_handle waiter, stream_handle on) STREAMSAFE_REQUIRES(mu_);
  void add_use_locked(block* b, stream_handle stream);  // record_stream: b's owner lock held
  void note_use_locked(segment* seg, stream_handle stream);
  void retire_pending_locked(stream_state& st, block* b) STREAMSAFE_REQUIRES(st.mu);
  void process_events_locked(stream_state& st) STREAMSAFE_REQUIRES(st.mu);
  block* take_pending_locked(stream_state& st, pool& p, std::size_t rounded)
      STREAMSAFE_REQUIRES(st.mu);
};

}  // namespace streamsafe::detail
