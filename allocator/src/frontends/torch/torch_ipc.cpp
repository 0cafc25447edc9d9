// streamsafe PyTorch extension: CUDA IPC of tensors (torch.multiprocessing, reduce_tensor /
// rebuild_cuda_tensor, Storage._share_cuda_ / _new_shared_cuda) over streamsafe's export and
// import (core/ipc.hpp), on both backends.
//
// PyTorch's protocol and what streamsafe adds:
//  * Producer: _share_cuda_ calls shareIpcHandle(storage pointer) for every send. Each call is a
//    new streamsafe export of the block (export_block); the handle carries the producer's pid and
//    block address, so that a consumer that receives the block twice maps it once. PyTorch then
//    counts the send in a shared-memory reference counter and keeps the storage (its "limbo")
//    until every consumer has let go: only then does our free run.
//  * Consumer: getIpcDevPtr(handle) imports the export (import_block; an open import of the same
//    producer block is shared instead). When PyTorch drops its last reference (the received
//    storage died), the import is released (release_import): its interprocess event is recorded
//    on the consumer's current stream, which PyTorch then synchronises before it decrements the
//    producer's counter.
//  * Producer free (PyTorch's counter reached zero): every export of the block is marked released
//    (ipc_release_of: the counter is PyTorch's release message) and the block is freed; the
//    streamsafe core holds the free, the block allocated and unreleasable, until each export's
//    event has completed, so that neither a reuse nor empty_cache touches it under a consumer's
//    read that was enqueued before its release.
// Expandable backend: the handle names the producer's file descriptors of the physical memory;
// the consumer fetches them with pidfd_getfd, which needs ptrace rights over the producer. The
// producer therefore allows any process of its user to trace it (prctl PR_SET_PTRACER_ANY, under
// Yama's ptrace_scope 1) at its first export with that backend.
#include "extension_allocator.hpp"

#include <sys/prctl.h>
#include <unistd.h>

namespace streamsafe::torch_ext {

namespace {

constexpr char k_magic[16] = {'s', 't', 'r', 'e', 'a', 'm', 's', 'a',
                              'f', 'e', '-', 'i', 'p', 'c', '/', '1'};

struct wire_header {
  char magic[16];
  std::int64_t producer_pid = 0;
  std::uint64_t block = 0;  // the block's address in the producer
  std::uint64_t size = 0;   // its size
  std::int32_t device = 0;  // the producer's device
  std::uint32_t core_bytes = 0;
};

std::string wrap(const streamsafe::ipc_handle& h, void* block, std::size_t size, int device) {
  wire_header w{};
  std::memcpy(w.magic, k_magic, sizeof k_magic);
  w.producer_pid = static_cast<std::int64_t>(::getpid());
  w.block = reinterpret_cast<std::uintptr_t>(block);
  w.size = size;
  w.device = device;
  w.core_bytes = static_cast<std::uint32_t>(h.bytes.size());
  std::string out(sizeof w + h.bytes.size(), '\0');
  std::memcpy(out.data(), &w, sizeof w);
  std::memcpy(out.data() + sizeof w, h.bytes.data(), h.bytes.size());
  return out;
}

bool unwrap(const std::string& text, wire_header& w, streamsafe::ipc_handle& h) {
  if (text.size() < sizeof w) return false;
  std::memcpy(&w, text.data(), sizeof w);
  if (std::memcmp(w.magic, k_magic, sizeof k_magic) != 0) return false;
  if (text.size() != sizeof w + w.core_bytes) return false;
  h.bytes.assign(reinterpret_cast<const std::uint8_t*>(text.data()) + sizeof w,
                 reinterpret_cast<const std::uint8_t*>(text.data()) + text.size());
  return true;
}

}  // namespace

cca::ShareableHandle torch_allocator::shareIpcHandle(void* ptr) {
  TORCH_CHECK(ptr, "streamsafe: shareIpcHandle of a null pointer");
  const int device = ss_->owner_device(ptr);
  TORCH_CHECK(device >= 0, "streamsafe: CUDA IPC (shareIpcHandle): ", ptr,
              " is not the start of a block streamsafe's device allocators handed out (a "
              "MemPool with its own allocator, or memory from elsewhere, cannot be shared)");
  if (options_.backend == streamsafe::backend_kind::expandable) {
    static std::once_flag once;
    std::call_once(once, [] {
#ifdef PR_SET_PTRACER
      (void)::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // EINVAL without Yama: fine
#endif
    });
  }
  streamsafe::ipc_handle h;
  std::size_t size = 0;
  guarded("CUDA IPC export (shareIpcHandle)", [&] {
    h = ss_->export_block(ptr);
    size = ss_->device_allocator(device).find_block(ptr).size_bytes;
  });
  {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    ipc_exports_[ptr].push_back(h);
    n_exported_.fetch_add(1, std::memory_order_acq_rel);
  }
  cca::ShareableHandle out;
  out.offset = 0;  // the handle names the block itself
  out.handle = wrap(h, ptr, size, device);
  return out;
}

// PyTorch frees a sent block only once its reference counter says every consumer has let go.
void torch_allocator::end_exports(void* ptr) {
  std::vector<streamsafe::ipc_handle> handles;
  {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    auto it = ipc_exports_.find(ptr);
    if (it == ipc_exports_.end()) return;
    handles = std::move(it->second);
    ipc_exports_.erase(it);
    n_exported_.fetch_sub(static_cast<int>(handles.size()), std::memory_order_acq_rel);
  }
  for (const streamsafe::ipc_handle& h : handles) {
    try {
      ss_->notify_import_released(streamsafe::ipc_release_of(h));
    } catch (const std::exception& e) {
      streamsafe::cuda::log_error(e.what());
    }
  }
}

std::shared_ptr<void> torch_allocator::getIpcDevPtr(std::string handle) {
  wire_header w{};
  streamsafe::ipc_handle h;
  TORCH_CHECK(unwrap(handle, w, h), "streamsafe: CUDA IPC (getIpcDevPtr): the handle (",
              handle.size(),
              " bytes) was not made by streamsafe; the producer process uses another CUDA "
              "allocator (PyTorch's own?): install streamsafe in both processes, or in neither");
  const c10::DeviceIndex device = c10::cuda::current_device();
  const auto key = std::make_tuple(w.producer_pid, w.block, static_cast<int>(device));
  std::lock_guard<std::mutex> serial(ipc_import_mu_);
  {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    auto it = ipc_imports_.find(key);
    if (it != ipc_imports_.end()) {
      if (std::shared_ptr<void> open = it->second.lock()) return open;  // mapped once
      ipc_imports_.erase(it);
    }
  }
  streamsafe::imported_block b;
  guarded("CUDA IPC import (getIpcDevPtr)", [&] { b = ss_->import_block(h, device); });
  // Should the control block's allocation throw, shared_ptr's constructor calls the deleter.
  std::shared_ptr<void> sp(
      b.ptr, [this, d = static_cast<int>(device)](void* p) { release_ipc_import(p, d); });
  std::lock_guard<std::mutex> lock(ipc_mu_);
  ipc_imports_[key] = sp;
  return sp;
}

// The consumer let go of the import: record its event on the current stream (PyTorch synchronises
// that stream next, then tells the producer through its reference counter).
void torch_allocator::release_ipc_import(void* ptr, int device) noexcept {
  try {
    const cudaStream_t stream =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    (void)ss_->release_import(ptr, stream);  // the producer ends the export at its own free
  } catch (const std::exception& e) {
    streamsafe::cuda::log_error(e.what());
  }
  try {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    for (auto it = ipc_imports_.begin(); it != ipc_imports_.end();) {
      it = it->second.expired() ? ipc_imports_.erase(it) : std::next(it);
    }
  } catch (...) {
  }
}

}  // namespace streamsafe::torch_ext
