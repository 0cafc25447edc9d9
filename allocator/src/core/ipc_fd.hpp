// streamsafe core: file descriptors of IPC handles (internal; ipc_fd.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace streamsafe::detail {

// The producer's descriptors `fds` (of process `pid`) duplicated into this process with
// pidfd_getfd; throws backend_error (naming the way round an EPERM) and closes what it got.
std::vector<int> fetch_ipc_fds(std::int64_t pid, const std::vector<int>& fds);
void close_fds(const std::vector<int>& fds) noexcept;

}  // namespace streamsafe::detail
