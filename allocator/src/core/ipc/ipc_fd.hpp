// streamsafe core: file descriptors of IPC handles (internal; ipc_fd.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace streamsafe::detail {

// The producer's descriptors `fds` (of process `pid`) duplicated into this process with
// pidfd_getfd; throws backend_error (naming the way round an EPERM) and closes what it got.
std::vector<int> fetch_ipc_fds(std::int64_t pid, const std::vector<int>& fds);
void close_fds(const std::vector<int>& fds) noexcept;
// Makes each of `fds` name /dev/null instead (dup2 over it): what it named is no longer held
// open by this process, and the number stays taken until close_fds, so that a consumer that
// fetches it later gets a descriptor no import accepts rather than whatever reused the number.
// Without a /dev/null to open, the descriptor is closed and its entry set to -1.
void retire_fds(std::vector<int>& fds) noexcept;

}  // namespace streamsafe::detail
