// streamsafe: libstreamsafe_torch_ext.so, the C entry points Python calls (streamsafe.torch):
// install the allocator (streamsafe_torch_ext_install), read its configuration and statistics,
// empty_cache, reclaim. The allocator itself is torch_allocator (extension_allocator.hpp).
#include "extension_allocator.hpp"

#include <cstddef>
#include <cstring>
#include <string>

#define STREAMSAFE_EXPORT extern "C" __attribute__((visibility("default")))

namespace streamsafe::torch_ext {

torch_allocator* g_allocator = nullptr;  // set once by install; never destroyed

void raw_delete_fn(void* ptr) {
  if (g_allocator) g_allocator->free(ptr);
}

}  // namespace streamsafe::torch_ext

using streamsafe::torch_ext::g_allocator;

// The PyTorch version this library was compiled against ("2.11.0").
STREAMSAFE_EXPORT const char* streamsafe_torch_ext_torch_version(void) { return TORCH_VERSION; }

// Installs streamsafe as PyTorch's CUDA allocator with options `conf` ("key:value,..."; NULL or
// "" reads STREAMSAFE_ALLOC_CONF), given on top of the PyTorch defaults k_torch_defaults
// (empty_cache:defer with the release worker: torch.cuda.empty_cache() never runs the driver's
// unmaps on the caller's thread; release_worker:auto is on for real GPUs in defer mode). Returns 0
// when installed now, 1 when it already was (conf is then ignored), -1 on error with the message in
// err (NUL-terminated, truncated to len): a bad configuration, or PyTorch's allocator already
// holding memory.
STREAMSAFE_EXPORT int streamsafe_torch_ext_install(const char* conf, char* err, size_t len) {
  namespace cca = c10::cuda::CUDACachingAllocator;
  try {
    if (g_allocator) return 1;
    static constexpr const char* k_torch_defaults = "empty_cache:defer,release_worker:auto";
    const char* env = std::getenv("STREAMSAFE_ALLOC_CONF");
    const std::string given = (conf && *conf) ? conf : (env ? env : "");
    // PyTorch's settings (PYTORCH_ALLOC_CONF wins over PYTORCH_CUDA_ALLOC_CONF, as in PyTorch)
    // apply under streamsafe's own: a key given in both takes streamsafe's value.
    const char* torch_env = std::getenv("PYTORCH_ALLOC_CONF");
    if (!torch_env) torch_env = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
    const std::string from_torch = torch_env
                                       ? streamsafe::torch_ext::torch_settings_to_options(torch_env)
                                       : std::string();
    streamsafe::options opts = streamsafe::options::parse(
        std::string(k_torch_defaults) + (from_torch.empty() ? "" : "," + from_torch) + "," + given);
    cca::CUDAAllocator* current = cca::allocator.load();
    if (current && current->initialized()) {
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;
      }
      for (int d = 0; d < n; ++d) {
        std::int64_t reserved = 0;
        try {
          reserved =
              current->getDeviceStats(static_cast<c10::DeviceIndex>(d)).reserved_bytes[0].current;
        } catch (const std::exception&) {
          continue;  // that device's allocator has not been created: it holds nothing
        }
        if (reserved > 0) {
          return streamsafe::detail::copy_text(
                     "streamsafe.torch.install: PyTorch's CUDA allocator (" + current->name() +
                         ") already holds " + std::to_string(reserved) + " bytes on device " +
                         std::to_string(d) +
                         "; install streamsafe before the first CUDA allocation (e.g. right "
                         "after import torch, "
                         "or with STREAMSAFE_TORCH_INSTALL=1)",
                     err, len),
                 -1;
        }
      }
    }
    // Never destroyed: tensors are freed during interpreter shutdown, after static destructors
    // would have run (PyTorch's own allocator is never destroyed either).
    auto* owner = new streamsafe::torch_ext::torch_allocator(opts, conf ? conf : "");
    owner->set_torch_settings_text(torch_env ? torch_env : "");
    g_allocator = owner;
    cca::allocator.store(owner);
    c10::SetAllocator(c10::DeviceType::CUDA, owner, /*priority=*/255);
    if (c10::GetAllocator(c10::DeviceType::CUDA) != owner) {
      return streamsafe::detail::copy_text(
                 "streamsafe.torch.install: c10::SetAllocator(kCUDA) did not take streamsafe's "
                 "allocator",
                 err, len),
             -1;
    }
    return 0;
  } catch (const std::exception& e) {
    return streamsafe::detail::copy_text(std::string("streamsafe.torch.install: ") + e.what(), err,
                                         len),
           -1;
  }
}

// torch.cuda.memory._set_allocator_settings(conf) after install: 0 when every key is applied
// or accepted, -1 with the refusal (naming the key) in err.
STREAMSAFE_EXPORT int streamsafe_torch_ext_settings(const char* conf, char* err, size_t len) {
  if (!g_allocator) return 0;  // not installed: PyTorch's own allocator takes them
  try {
    g_allocator->apply_torch_settings(conf ? conf : "");
    return 0;
  } catch (const std::exception& e) {
    return streamsafe::detail::copy_text(e.what(), err, len), -1;
  }
}

// 1 when streamsafe's allocator is PyTorch's current CUDA allocator.
STREAMSAFE_EXPORT int streamsafe_torch_ext_installed(void) {
  return g_allocator && c10::cuda::CUDACachingAllocator::allocator.load() == g_allocator ? 1 : 0;
}

// The options in use ("backend:...,empty_cache:...") into buf; returns the full length, -1 when
// not installed.
STREAMSAFE_EXPORT int streamsafe_torch_ext_config(char* buf, size_t len) {
  if (!g_allocator) return -1;
  return streamsafe::detail::copy_text(g_allocator->core().config().to_string(), buf, len);
}

// Device statistics as JSON (PyTorch's flat keys plus streamsafe's own counters and
// "pending_release_bytes"); returns the full length, -1 on error (not installed, bad device).
STREAMSAFE_EXPORT int streamsafe_torch_ext_stats_json(int device, char* buf, size_t len) {
  if (!g_allocator) return -1;
  try {
    auto& a = g_allocator->core();
    std::ostringstream os;
    streamsafe::write_statistics_json(os, a.stats(device));
    std::string text = os.str();
    const streamsafe::caching_allocator* d = a.find_device_allocator(device);
    const std::size_t pending = d ? d->pending_release_bytes() : 0;
    const std::size_t held = d ? d->held_free_count() : 0;
    const auto close = text.rfind('}');
    if (close != std::string::npos) {
      text.insert(close,
                  std::string(text.size() > 2 ? ", " : "") + "\"pending_release_bytes\": " +
                      std::to_string(pending) + ", \"held_free_count\": " + std::to_string(held) +
                      ", \"backed_bytes\": " + std::to_string(g_allocator->backed_bytes(device)) +
                      ", \"limit_bytes\": " + std::to_string(g_allocator->limit_bytes(device)) +
                      ", \"pool_instances\": " + std::to_string(g_allocator->pool_instances()));
    }
    return streamsafe::detail::copy_text(text, buf, len);
  } catch (const std::exception& e) {
    return streamsafe::detail::copy_text(std::string("{\"error\": \"") + e.what() + "\"}", buf,
                                         len),
           -1;
  }
}

// What holds device memory on one device, for a breakdown (streamsafe.torch.memory_breakdown):
// one entry per segment, without its blocks ({"tag", "graph" (the capture id of a graph's
// private pool, 0 for none), "stream", "mapped", "allocated" (live blocks), "paused"}), the IPC
// counts, and the bytes queued for release. Returns the full length, -1 on error.
STREAMSAFE_EXPORT int streamsafe_torch_ext_segments_json(int device, char* buf, size_t len) {
  if (!g_allocator) return -1;
  try {
    auto& a = g_allocator->core();
    const streamsafe::caching_allocator* d = a.find_device_allocator(device);
    std::ostringstream os;
    os << "{\"segments\": [";
    if (d) {
      const streamsafe::memory_snapshot snap = d->snapshot();
      bool first = true;
      for (const streamsafe::segment_snapshot& seg : snap.segments) {
        std::string tag;
        for (char c : seg.tag)
          tag += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
        os << (first ? "" : ", ") << "{\"tag\": \"" << tag << "\", \"graph\": " << seg.graph_pool
           << ", \"stream\": " << seg.stream << ", \"mapped\": " << seg.mapped_bytes
           << ", \"allocated\": "
           << seg.bytes_in(streamsafe::snapshot_block_state::active) +
                  seg.bytes_in(streamsafe::snapshot_block_state::pending_free)
           << ", \"paused\": " << seg.paused_bytes << "}";
        first = false;
      }
    }
    os << "]";
    if (d) {
      const auto ipc = d->ipc_status();
      os << ", \"ipc_exports\": " << ipc.exports << ", \"ipc_held_frees\": " << ipc.held_frees
         << ", \"ipc_imports\": " << ipc.imports << ", \"ipc_closing\": " << ipc.closing
         << ", \"pending_release_bytes\": " << d->pending_release_bytes();
    }
    os << "}";
    return streamsafe::detail::copy_text(os.str(), buf, len);
  } catch (const std::exception& e) {
    return streamsafe::detail::copy_text(std::string("{\"error\": \"") + e.what() + "\"}", buf,
                                         len),
           -1;
  }
}

// Bytes waiting in the deferred-release queues (every device).
STREAMSAFE_EXPORT size_t streamsafe_torch_ext_pending_release_bytes(void) {
  if (!g_allocator) return 0;
  auto& a = g_allocator->core();
  std::size_t total = 0;
  for (int d = 0; d < a.device_count(); ++d)
    if (const auto* c = a.find_device_allocator(d)) total += c->pending_release_bytes();
  return total;
}

// Finishes deferred releases whose fences completed (never blocks); returns bytes released.
STREAMSAFE_EXPORT size_t streamsafe_torch_ext_reclaim(void) {
  if (!g_allocator) return 0;
  try {
    return g_allocator->core().reclaim();
  } catch (const std::exception& e) {
    streamsafe::cuda::log_error(e.what());
    return 0;
  }
}

// streamsafe's empty_cache with the configured mode; returns bytes released (0 when not installed).
STREAMSAFE_EXPORT size_t streamsafe_torch_ext_empty_cache(void) {
  if (!g_allocator) return 0;
  try {
    return g_allocator->core().empty_cache();
  } catch (const std::exception& e) {
    streamsafe::cuda::log_error(e.what());
    return 0;
  }
}

// ---- tags and sleep/wake (docs/sleep.md) -----------------------------------------------------
// Each call returns 0, or -1 with {"error": "..."} in out; the pause calls write the tag's status
// as JSON into out (truncated to len).
namespace {

struct tag_frame {
  std::unique_ptr<streamsafe::tag_scope> thread;
  std::unique_ptr<streamsafe::process_tag_scope> process;  // all_threads: autograd's too
};
thread_local std::vector<tag_frame> t_tags;

std::string quoted(std::string text) {
  for (char& c : text) c = (c == '"' || c == '\\') ? '\'' : c;
  return text;
}

std::string status_json(const streamsafe::pause_status& s) {
  return "{\"tag\": \"" + s.tag + "\", \"phase\": \"" + streamsafe::to_string(s.phase) +
         "\", \"released_bytes\": " + std::to_string(s.released_bytes) +
         ", \"pending_bytes\": " + std::to_string(s.pending_bytes) +
         ", \"offloaded_host_bytes\": " + std::to_string(s.offloaded_host_bytes) +
         ", \"allocated_bytes\": " + std::to_string(s.allocated_bytes) +
         ", \"reserved_bytes\": " + std::to_string(s.reserved_bytes) + ", \"error\": \"" +
         quoted(s.error) + "\"}";
}

template <class F>
int json_call(char* out, size_t len, F&& f) {
  try {
    if (!g_allocator) throw std::logic_error("streamsafe: the extension is not installed");
    return streamsafe::detail::copy_text(f(), out, len) < 0 ? -1 : 0;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    for (char& c : msg) c = c == '"' ? '\'' : c;
    streamsafe::detail::copy_text(
        "{\"error\": \"" + msg + "\", \"kind\": \"" +
            (dynamic_cast<const streamsafe::out_of_memory*>(&e) ? "out_of_memory" : "error") +
            "\"}",
        out, len);
    return -1;
  }
}

streamsafe::caching_allocator& device_allocator(int device) {
  auto& a = g_allocator->core();
  return a.device_allocator(device < 0 ? a.current_device() : device);
}

}  // namespace

STREAMSAFE_EXPORT int streamsafe_torch_ext_tag_push(const char* tag, int all_threads, char* out,
                                                    size_t len) {
  return json_call(out, len, [&] {
    tag_frame f;
    f.thread = std::make_unique<streamsafe::tag_scope>(tag ? tag : "");
    if (all_threads) f.process = std::make_unique<streamsafe::process_tag_scope>(tag);
    t_tags.push_back(std::move(f));
    return std::string("{}");
  });
}

STREAMSAFE_EXPORT int streamsafe_torch_ext_tag_pop(char* out, size_t len) {
  return json_call(out, len, [&] {
    if (t_tags.empty())
      throw std::logic_error("streamsafe: tag pop with no tag pushed on this thread");
    t_tags.pop_back();
    return std::string("{}");
  });
}

STREAMSAFE_EXPORT int streamsafe_torch_ext_pause(const char* tag, int device, int offload, int wait,
                                                 char* out, size_t len) {
  return json_call(out, len, [&] {
    return status_json(device_allocator(device).pause(
        tag ? tag : "", offload ? streamsafe::pause_mode::offload : streamsafe::pause_mode::discard,
        wait ? streamsafe::empty_cache_mode::wait : streamsafe::empty_cache_mode::defer));
  });
}

STREAMSAFE_EXPORT int streamsafe_torch_ext_resume(const char* tag, int device, void* stream,
                                                  int async, char* out, size_t len) {
  return json_call(out, len, [&] {
    auto& a = device_allocator(device);
    const std::string name = tag ? tag : "";
    const auto s = reinterpret_cast<std::uintptr_t>(stream);
    if (async) return status_json(stream ? a.resume_async(name, s) : a.resume_async(name));
    return status_json(stream ? a.resume(name, s) : a.resume(name));
  });
}

STREAMSAFE_EXPORT int streamsafe_torch_ext_wait_resumed(const char* tag, int device,
                                                        long long timeout_ms, char* out,
                                                        size_t len) {
  return json_call(out, len, [&] {
    return status_json(device_allocator(device).wait_resumed(
        tag ? tag : "", std::chrono::milliseconds(timeout_ms)));
  });
}

STREAMSAFE_EXPORT int streamsafe_torch_ext_tag_status(const char* tag, int device, char* out,
                                                      size_t len) {
  return json_call(
      out, len, [&] { return status_json(device_allocator(device).tag_status(tag ? tag : "")); });
}

STREAMSAFE_EXPORT int streamsafe_torch_ext_empty_cache_tag(const char* tag, char* out, size_t len) {
  return json_call(out, len, [&] {
    return "{\"released_bytes\": " +
           std::to_string(g_allocator->core().empty_cache(tag ? tag : "")) + "}";
  });
}

STREAMSAFE_EXPORT int streamsafe_torch_ext_trim(size_t bytes_to_keep, char* out, size_t len) {
  return json_call(out, len, [&] {
    return "{\"released_bytes\": " + std::to_string(g_allocator->core().trim(bytes_to_keep)) + "}";
  });
}
