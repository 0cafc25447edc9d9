// streamsafe core: the IPC bookkeeping of one allocator (internal; ipc.cpp has the policy).
//
// Producer side: one export record per export_block call, keyed by its id, alive until the
// consumer's release has been seen complete (or revoke_exports); frees of exported blocks held
// until the block's last export ends. Consumer side: the imports open in this process, keyed by
// their address, and the released ones whose consumer event has not been seen complete (their
// mapping is closed once it has). All guarded by the device lock (mu_).
#pragma once

#include "core/blocks/block.hpp"

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace streamsafe::detail {

struct ipc_export_record {
  block* b = nullptr;
  event_handle event = 0;  // the interprocess event the consumer records at its release
  std::vector<int> fds;    // the producer's descriptors named by the handle (closed at the end)
  bool released = false;   // notify_import_released seen: the consumer has recorded `event`
  bool retired = false;    // a pause gave the memory back: `fds` name /dev/null (ipc_fd.hpp)
};

struct ipc_held_free {
  block* b = nullptr;
  bool has_stream = false;
  stream_handle stream = 0;
};

struct ipc_import_record {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::uint64_t producer = 0;  // the producer allocator's key
  std::uint64_t export_id = 0;
  int producer_device = 0;
  event_handle event = 0;  // the producer's interprocess event, opened here
  bool released = false;   // release_import recorded `event`; closed once it completes
};

struct ipc_registry {
  std::uint64_t key = 0;  // this allocator, across processes: pid and allocator id
  std::uint64_t next_export_id = 1;
  std::map<std::uint64_t, ipc_export_record> exports;   // by export id
  std::vector<ipc_held_free> held;                      // producer frees waiting for exports
  std::map<std::uintptr_t, ipc_import_record> imports;  // open (not released), by address
  std::vector<ipc_import_record> closing;               // released, event not seen complete
  // Every export imported here, by (producer key, export id), kept after the import closes: an
  // export has one consumer and one import, since its producer ends it at the first release.
  std::set<std::pair<std::uint64_t, std::uint64_t>> imported;
  int waits_in_flight = 0;  // empty_cache(wait) waiting on export events with mu_ dropped
};

}  // namespace streamsafe::detail
