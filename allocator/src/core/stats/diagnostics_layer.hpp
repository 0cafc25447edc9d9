// streamsafe core: what the allocator says about its own state (internal): the out-of-memory
// and invalid-pointer errors (diagnostics.cpp) and check_invariants' checkers, one per
// structure (invariants.cpp; check_ipc_locked in ipc.cpp). They read the state and call only
// the layers beneath (blocks/block_layer.hpp has the chain).
#pragma once

#include "core/growth/growth_layer.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

namespace streamsafe::detail {

struct diagnostics_layer : growth_layer {
  using growth_layer::growth_layer;

  struct census;  // invariants.cpp
  // diagnostics.cpp
  ledger_view ledger_view_locked() const STREAMSAFE_REQUIRES(mu_);  // every held byte's state
  std::string oom_message_locked(std::size_t size, std::size_t rounded, stream_handle stream,
                                 const stream_state* held) STREAMSAFE_REQUIRES(mu_);
  std::size_t largest_free_locked(const stream_state* held) const STREAMSAFE_REQUIRES(mu_);
  [[noreturn]] void throw_out_of_memory_locked(device_lock& dlk,
                                               detail::unique_lock<stream_lock>* slk,
                                               std::size_t size, std::size_t rounded,
                                               stream_handle stream, const stream_state* held,
                                               const std::string& note) STREAMSAFE_REQUIRES(mu_);
  [[noreturn]] void throw_invalid_pointer_locked(const void* ptr, const char* what) const
      STREAMSAFE_REQUIRES(mu_);
  // invariants.cpp (mu_ and every stream lock held)
  void check_block_locked(const block* b, census& c) const STREAMSAFE_REQUIRES(mu_);
  void check_segment_locked(std::uintptr_t key, const segment* seg, census& c) const
      STREAMSAFE_REQUIRES(mu_);
  void check_pool_locked(const pool& p, census& c) const STREAMSAFE_REQUIRES(mu_);
  void check_stream_locked(const stream_state& st, census& c) const STREAMSAFE_REQUIRES(mu_, st.mu);
  void check_releasing_segments_locked(census& c) const STREAMSAFE_REQUIRES(mu_);
  void check_held_frees_locked(const census& c) const STREAMSAFE_REQUIRES(mu_);
  void check_census_locked(const census& c) const STREAMSAFE_REQUIRES(mu_);
  void check_dead_streams_locked() const STREAMSAFE_REQUIRES(mu_);
  void check_ipc_locked() const STREAMSAFE_REQUIRES(mu_);
};

}  // namespace streamsafe::detail
