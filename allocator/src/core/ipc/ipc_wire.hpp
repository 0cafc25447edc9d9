// streamsafe core: the byte layout of IPC handles and release messages (internal; ipc.cpp writes
// and reads them, ipc_fd.cpp rewrites the descriptors of a handle sent over a socket).
//
// Both ends run on one machine (CUDA IPC is local), so fields are in host byte order.
//   handle:  header | event bytes | memory bytes | fds (int32 each, fd_count of them, last)
//   release: release_header
// A version change makes older peers refuse the bytes (ipc_error), never misread them.
#pragma once

#include <streamsafe/core/errors.hpp>
#include <streamsafe/core/ipc.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace streamsafe::detail {

inline constexpr std::uint32_t k_ipc_handle_magic = 0x48495353;   // "SSIH"
inline constexpr std::uint32_t k_ipc_release_magic = 0x52495353;  // "SSIR"
inline constexpr std::uint16_t k_ipc_version = 1;
inline constexpr std::uint16_t k_ipc_fds_local = 1;  // the fds are the holder's own (received)
inline constexpr std::uint32_t k_ipc_max_fds = 4096;

struct ipc_handle_header {
  std::uint32_t magic = k_ipc_handle_magic;
  std::uint16_t version = k_ipc_version;
  std::uint16_t flags = 0;
  std::uint64_t producer = 0;  // the producer allocator's key
  std::int64_t producer_pid = 0;
  std::uint64_t export_id = 0;
  std::uint64_t size_bytes = 0;  // the block's size
  std::int32_t device = 0;       // the producer's device index
  std::uint32_t fd_count = 0;
  std::uint32_t event_bytes = 0;
  std::uint32_t memory_bytes = 0;
};

struct ipc_release_header {
  std::uint32_t magic = k_ipc_release_magic;
  std::uint16_t version = k_ipc_version;
  std::uint16_t reserved = 0;
  std::uint64_t producer = 0;
  std::uint64_t export_id = 0;
  std::int32_t device = 0;  // the producer's device index
  std::uint32_t padding = 0;
};

// A handle split into its parts; parse_ipc_handle checks every length.
struct ipc_handle_parts {
  ipc_handle_header header;
  std::vector<std::uint8_t> event;
  std::vector<std::uint8_t> memory;
  std::vector<int> fds;
};

inline ipc_handle make_ipc_handle(const ipc_handle_parts& p) {
  ipc_handle h;
  h.bytes.resize(sizeof(ipc_handle_header) + p.event.size() + p.memory.size() +
                 p.fds.size() * sizeof(std::int32_t));
  std::uint8_t* at = h.bytes.data();
  std::memcpy(at, &p.header, sizeof p.header);
  at += sizeof p.header;
  if (!p.event.empty()) std::memcpy(at, p.event.data(), p.event.size());
  at += p.event.size();
  if (!p.memory.empty()) std::memcpy(at, p.memory.data(), p.memory.size());
  at += p.memory.size();
  for (int fd : p.fds) {
    const std::int32_t v = fd;
    std::memcpy(at, &v, sizeof v);
    at += sizeof v;
  }
  return h;
}

// Throws ipc_error naming `what` (the calling API) for bytes that are not a version-1 handle.
inline ipc_handle_parts parse_ipc_handle(const ipc_handle& h, const char* what) {
  auto bad = [&](const std::string& why) {
    throw ipc_error(std::string("streamsafe: ") + what + ": not an IPC handle of this version (" +
                    why + "; " + std::to_string(h.bytes.size()) + " bytes)");
  };
  ipc_handle_parts p;
  if (h.bytes.size() < sizeof(ipc_handle_header)) bad("too short");
  std::memcpy(&p.header, h.bytes.data(), sizeof p.header);
  if (p.header.magic != k_ipc_handle_magic) bad("bad magic");
  if (p.header.version != k_ipc_version) bad("version " + std::to_string(p.header.version));
  if (p.header.fd_count > k_ipc_max_fds) bad("too many descriptors");
  const std::uint64_t want = std::uint64_t{sizeof(ipc_handle_header)} + p.header.event_bytes +
                             p.header.memory_bytes +
                             std::uint64_t{p.header.fd_count} * sizeof(std::int32_t);
  if (want != h.bytes.size()) bad("length fields disagree with the size");
  const std::uint8_t* at = h.bytes.data() + sizeof p.header;
  p.event.assign(at, at + p.header.event_bytes);
  at += p.header.event_bytes;
  p.memory.assign(at, at + p.header.memory_bytes);
  at += p.header.memory_bytes;
  for (std::uint32_t i = 0; i < p.header.fd_count; ++i) {
    std::int32_t v = 0;
    std::memcpy(&v, at, sizeof v);
    at += sizeof v;
    p.fds.push_back(v);
  }
  return p;
}

inline ipc_release make_ipc_release(const ipc_release_header& r) {
  ipc_release out;
  out.bytes.resize(sizeof r);
  std::memcpy(out.bytes.data(), &r, sizeof r);
  return out;
}

inline ipc_release_header parse_ipc_release(const ipc_release& r, const char* what) {
  ipc_release_header h;
  if (r.bytes.size() != sizeof h) {
    throw ipc_error(std::string("streamsafe: ") + what + ": not an IPC release message (" +
                    std::to_string(r.bytes.size()) + " bytes, expected " +
                    std::to_string(sizeof h) + ")");
  }
  std::memcpy(&h, r.bytes.data(), sizeof h);
  if (h.magic != k_ipc_release_magic || h.version != k_ipc_version) {
    throw ipc_error(std::string("streamsafe: ") + what +
                    ": not an IPC release message of this version (bad magic or version)");
  }
  return h;
}

}  // namespace streamsafe::detail
