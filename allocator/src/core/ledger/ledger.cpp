// streamsafe core: the ledger's text for messages (ledger.hpp holds the states and their rules).
#include "core/ledger/ledger.hpp"

#include "core/common/format.hpp"

#include <sstream>

namespace streamsafe::detail {

std::string describe(const ledger_view& v) {
  std::ostringstream os;
  os << "reserved " << bytes_with_count(v.reserved) << " = live " << bytes_with_count(v.live)
     << " + pending other streams' work " << bytes_with_count(v.pending) << " + queued for release "
     << bytes_with_count(v.queued) << " + being released " << bytes_with_count(v.releasing)
     << " + cached " << bytes_with_count(v.cached) << " (held by graphs' private pools "
     << bytes_with_count(v.graph) << "); not held: paused " << bytes_with_count(v.paused)
     << ", offloaded to host " << bytes_with_count(v.offloaded_host) << "; exported "
     << bytes_with_count(v.exported) << ", imported " << bytes_with_count(v.imported) << "; limit "
     << bytes_with_count(v.limit);
  return os.str();
}

}  // namespace streamsafe::detail
