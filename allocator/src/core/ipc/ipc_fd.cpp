// streamsafe core: how the file descriptors of an IPC handle reach the consumer (core/ipc.hpp).
//
// A handle of the expandable backend names descriptors of shareable physical memory that are
// open in the producer. Two ways across:
//  * send_ipc_handle / receive_ipc_handle: the handle's bytes over a connected Unix-domain socket
//    with the descriptors as SCM_RIGHTS ancillary data; the receiver's kernel installs copies and
//    the received handle names those (flag k_ipc_fds_local).
//  * fetch_ipc_fds (import_block, for a handle shipped as plain bytes): pidfd_open on the
//    producer's pid and pidfd_getfd for each descriptor (Linux 5.6+; the caller needs ptrace
//    rights over the producer: same user and, under Yama ptrace_scope 1, the producer's
//    prctl(PR_SET_PTRACER, consumer pid)).
// Plain POSIX; no CUDA.
#include "core/ipc/ipc_fd.hpp"

#include "core/ipc/ipc_wire.hpp"

#include <streamsafe/core/errors.hpp>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace streamsafe {
namespace {

[[noreturn]] void throw_errno(const char* call, int err) {
  throw backend_error(std::string("streamsafe: ") + call + " failed: " + std::strerror(err) +
                      " (errno " + std::to_string(err) + ")");
}

// Writes/reads exactly n bytes, retrying on EINTR and short transfers.
void write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n != 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw_errno("send_ipc_handle: send", errno);
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void read_all(int fd, void* data, std::size_t n) {
  auto* p = static_cast<std::uint8_t*>(data);
  while (n != 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) throw backend_error("streamsafe: receive_ipc_handle: the peer closed the socket");
    if (r < 0) throw_errno("receive_ipc_handle: recv", errno);
    p += r;
    n -= static_cast<std::size_t>(r);
  }
}

}  // namespace

void send_ipc_handle(int socket_fd, const ipc_handle& handle) {
  const detail::ipc_handle_parts parts = detail::parse_ipc_handle(handle, "send_ipc_handle");
  // One message: the length, then (with the descriptors attached to its first byte) the bytes.
  const std::uint64_t length = handle.bytes.size();
  write_all(socket_fd, &length, sizeof length);
  std::size_t sent = 0;
  if (!parts.fds.empty()) {
    std::vector<char> control(CMSG_SPACE(parts.fds.size() * sizeof(int)), 0);
    iovec iov{const_cast<std::uint8_t*>(handle.bytes.data()), handle.bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(parts.fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), parts.fds.data(), parts.fds.size() * sizeof(int));
    ssize_t w = -1;
    do {
      w = ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL);
    } while (w < 0 && errno == EINTR);
    if (w <= 0) throw_errno("send_ipc_handle: sendmsg", errno);
    sent = static_cast<std::size_t>(w);
  }
  write_all(socket_fd, handle.bytes.data() + sent, handle.bytes.size() - sent);
}

ipc_handle receive_ipc_handle(int socket_fd) {
  std::uint64_t length = 0;
  read_all(socket_fd, &length, sizeof length);
  if (length < sizeof(detail::ipc_handle_header) || length > (std::uint64_t{1} << 20)) {
    throw ipc_error("streamsafe: receive_ipc_handle: a message of " + std::to_string(length) +
                    " bytes is not an IPC handle");
  }
  ipc_handle h;
  h.bytes.resize(static_cast<std::size_t>(length));
  std::vector<char> control(CMSG_SPACE(detail::k_ipc_max_fds * sizeof(int)), 0);
  iovec iov{h.bytes.data(), h.bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t r = -1;
  do {
    r = ::recvmsg(socket_fd, &msg, MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r == 0) throw backend_error("streamsafe: receive_ipc_handle: the peer closed the socket");
  if (r < 0) throw_errno("receive_ipc_handle: recvmsg", errno);
  std::vector<int> received;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const std::size_t at = received.size();
    received.resize(at + n);
    std::memcpy(received.data() + at, CMSG_DATA(c), n * sizeof(int));
  }
  auto close_received = [&] {
    for (int fd : received) ::close(fd);
  };
  try {
    read_all(socket_fd, h.bytes.data() + r, h.bytes.size() - static_cast<std::size_t>(r));
    detail::ipc_handle_parts parts = detail::parse_ipc_handle(h, "receive_ipc_handle");
    if ((msg.msg_flags & MSG_CTRUNC) != 0 || received.size() != parts.fds.size()) {
      throw ipc_error("streamsafe: receive_ipc_handle: the handle names " +
                      std::to_string(parts.fds.size()) + " descriptor(s), " +
                      std::to_string(received.size()) + " arrived");
    }
    parts.fds = received;
    parts.header.flags |= detail::k_ipc_fds_local;
    return detail::make_ipc_handle(parts);
  } catch (...) {
    close_received();
    throw;
  }
}

namespace detail {

std::vector<int> fetch_ipc_fds(std::int64_t pid, const std::vector<int>& fds) {
  std::vector<int> out;
  if (fds.empty()) return out;
  const long pidfd = ::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0);
  if (pidfd < 0) throw_errno("import_block: pidfd_open(producer pid)", errno);
  try {
    for (int fd : fds) {
      const long local = ::syscall(SYS_pidfd_getfd, static_cast<int>(pidfd), fd, 0);
      if (local < 0) {
        const int err = errno;
        throw backend_error(
            std::string("streamsafe: import_block: pidfd_getfd(producer ") + std::to_string(pid) +
            ", fd " + std::to_string(fd) + ") failed: " + std::strerror(err) +
            (err == EPERM ? " (no ptrace rights over the producer: send the handle with "
                            "send_ipc_handle over a Unix socket, or let the producer call "
                            "prctl(PR_SET_PTRACER, ...))"
                          : ""));
      }
      out.push_back(static_cast<int>(local));
    }
  } catch (...) {
    close_fds(out);
    ::close(static_cast<int>(pidfd));
    throw;
  }
  ::close(static_cast<int>(pidfd));
  return out;
}

void close_fds(const std::vector<int>& fds) noexcept {
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
}

void retire_fds(std::vector<int>& fds) noexcept {
  if (fds.empty()) return;
  const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (int& fd : fds) {
    if (fd < 0) continue;
    // dup3 closes what fd named and makes it name /dev/null in one step.
    if (null >= 0 && ::dup3(null, fd, O_CLOEXEC) == fd) continue;
    ::close(fd);
    fd = -1;
  }
  if (null >= 0) ::close(null);
}

}  // namespace detail
}  // namespace streamsafe
