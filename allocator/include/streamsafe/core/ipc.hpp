// streamsafe: interprocess sharing of blocks (IPC): the handle and release message types and the
// file-descriptor passing helpers. The calls live on caching_allocator (export_block,
// notify_import_released, revoke_exports on the producer; import_block, release_import on the
// consumer); docs/reliability.md has the protocol.
//
// Protocol (two processes, any channel for the bytes):
//  1. producer: h = export_block(p). p stays allocated; its export count rises by one.
//  2. h.bytes travel to the consumer (a pipe, a socket, a file). For the expandable backend the
//     handle also names file descriptors of the producer (shareable physical memory): either send
//     it with send_ipc_handle over a Unix socket (SCM_RIGHTS; receive_ipc_handle on the other
//     end), or ship the bytes alone and let import_block fetch the descriptors with pidfd_getfd
//     (Linux 5.6+, needs ptrace rights over the producer, e.g. prctl(PR_SET_PTRACER)).
//  3. consumer: b = import_block(h) maps the same bytes at b.ptr (b.size_bytes of them).
//  4. consumer: r = release_import(b.ptr, s) records the export's interprocess event on stream s
//     (after the consumer's last use) and returns a release message; the mapping is closed by the
//     consumer's allocator once that event has completed.
//  5. r.bytes travel back; producer: notify_import_released(r).
// The producer's free of p (deallocate) is held, p counting as allocated, until every export of
// p is released and each consumer event has completed; until then empty_cache and the
// out-of-memory path neither reuse nor release p's memory. A consumer that dies without step 4-5
// leaves p held: revoke_exports(p) drops its exports (the caller asserts no consumer still
// touches p, as after the consumer process has exited).
//
// streamsafe orders the producer's reuse after the consumer's use, not the consumer's first use
// after the producer's writes: synchronize the producer's stream (or share an event) before the
// handle is sent.
// Handles are bytes, valid while the producer's allocator lives. Units: bytes. Thread safety:
// the types are values; the helpers may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace streamsafe {

// What export_block returns: the bytes another process gives to import_block. The descriptor
// numbers inside are the producer's (send_ipc_handle replaces them with the receiver's).
struct ipc_handle {
  std::vector<std::uint8_t> bytes;
};

// What release_import returns: the bytes the producer gives to notify_import_released.
struct ipc_release {
  std::vector<std::uint8_t> bytes;
};

// What import_block returns: the imported block's first byte in this process and its size.
struct imported_block {
  void* ptr = nullptr;
  std::size_t size_bytes = 0;
  std::uint64_t export_id = 0;  // the producer's id of this export (for messages)
};

// The producer's device index named by a handle / a release message (front ends route by it).
// Throws ipc_error for malformed bytes.
int ipc_handle_device(const ipc_handle& handle);
int ipc_release_device(const ipc_release& release);

// The release message of `handle`'s export, as release_import returns it to a consumer: for a
// front end whose own protocol tells the producer that every consumer of the export is done
// (PyTorch's reference counting of sent tensors). Given to notify_import_released, the export
// ends once its interprocess event, recorded by the consumer's release_import if there was one,
// has completed. Throws ipc_error for malformed bytes.
ipc_release ipc_release_of(const ipc_handle& handle);

// Sends `handle` over the connected Unix-domain socket `socket_fd`: its bytes and, as SCM_RIGHTS
// ancillary data, the file descriptors it names (duplicated into the receiver by the kernel).
// Throws ipc_error for a malformed handle, backend_error when sendmsg fails.
void send_ipc_handle(int socket_fd, const ipc_handle& handle);
// Receives one handle sent by send_ipc_handle; the descriptors it names are then this process's
// own (import_block closes them). Throws ipc_error for a malformed message, backend_error when
// recvmsg fails or the peer closed the socket.
ipc_handle receive_ipc_handle(int socket_fd);

}  // namespace streamsafe
