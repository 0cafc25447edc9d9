// streamsafe core: the graph-capture state (internal; capture.cpp has the rules, case K11):
// the captures underway, the graphs the allocator has given an id, the frees held until a
// capture ends or a graph is released, and the requests put off until the last capture ends.
// Also the routes into graphs' private pools outside a capture (graph_pool_route.cpp).
// Lock rule: impl::capture_ is GUARDED_BY(mu_), the device lock; every member is read and
// written under it. Its lock-free mirrors, impl::captures_underway_ and impl::routes_open_
// (atomics, beside it), hold captures.size() and routes.size() so that the fast paths test for
// a capture or a route without mu_.
#pragma once

#include "core/blocks/block.hpp"

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace streamsafe::detail {

// A capture underway on one stream of the device.
struct capture_record {
  stream_handle stream = 0;
  std::uint64_t graph = 0;  // the id notify_capture_begin returned
  std::uint64_t pool = 0;   // the graph whose private pool it allocates into (graph, or shared)
  bool detected = false;    // found by backend_.stream_is_capturing, not announced
  bool joined = false;      // a side stream that joined the capture of another record's stream
  std::uint64_t capture_id = 0;  // backend_.capture_id (0: not asked yet, or unknown)
};

// A graph the allocator has given an id: the private pool it allocates into (its own, keyed
// graph_key(graph), or an earlier graph's that it shares) and whether it was released.
struct graph_record {
  std::uint64_t pool = 0;
  bool released = false;
};

// A free made during a capture that could not complete then (see capture.cpp).
struct held_free {
  block* b = nullptr;
  bool has_stream = false;
  stream_handle stream = 0;
  std::uint64_t graph = 0;  // 0: completes when no capture is underway; else at its release
  // A free in the capture's own pool whose other uses are all streams of that capture: where
  // each of them stood in the capture (backend_.capture_position). Once the capturing stream
  // follows every one, the block serves it again inside the capture. Empty: not known.
  std::uint64_t join_graph = 0;
  std::vector<std::vector<std::uintptr_t>> positions;
};

// A route of allocations into a graph's private pool outside a capture.
struct pool_route {
  std::uint64_t id = 0;
  std::uint64_t pool = 0;  // the graph whose private pool it allocates into
  std::function<bool(stream_handle)> filter;
};

// The stream-registry key of graph `graph`'s private pool.
constexpr stream_handle graph_key(std::uint64_t graph) { return ~stream_handle{0} - graph; }

struct capture_state {
  std::vector<capture_record> captures;
  std::vector<held_free> held_frees;
  std::unordered_map<std::uint64_t, graph_record> graphs;
  std::vector<pool_route> routes;  // innermost last
  std::uint64_t next_route_id = 1;
  std::vector<std::uint64_t> releases_after;  // notify_graph_released during a capture
  bool empty_cache_after = false;             // empty_cache asked for during a capture
  std::uint64_t next_graph_id = 1;
  std::uint64_t deferrals = 0;  // releases/queries skipped because of a capture

  // The capture underway on `stream`, or null.
  const capture_record* find(stream_handle stream) const noexcept {
    for (const auto& c : captures) {
      if (c.stream == stream) return &c;
    }
    return nullptr;
  }
};

}  // namespace streamsafe::detail
