// Two processes share a block through streamsafe's IPC, on a real GPU.
//
// The producer (this process) forks and re-executes itself as the consumer, connected by a
// Unix-domain socket pair. Each round: the producer allocates and fills a block, exports it and
// sends the handle (send_ipc_handle: bytes plus descriptors by SCM_RIGHTS); the consumer imports
// it, enqueues a long spin and then a kernel that sums the block's bytes, releases the import
// (its event recorded after the read) and sends the release message back. The producer then,
// while the consumer's read is still queued, frees the block, reallocates the same size and
// overwrites what it got, notifies the release and calls empty_cache (wait or defer), churns,
// and finally compares the consumer's sum with the bytes it wrote first. A sum that differs
// means the producer reused the block under the consumer; a CUDA error in the consumer (an
// illegal address) means it released the memory under it. A control round revokes the export
// before the free (the unsafe behaviour) and must see the consumer read the overwritten bytes.
// Where no GPU is present it prints a skip line and exits 0.
//   usage: streamsafe_ipc_gpu_test            (producer; exit 0 = every round passed)
#include <streamsafe/backends/cuda_malloc_backend.hpp>
#include <streamsafe/backends/expandable_backend.hpp>
#include <streamsafe/core/caching_allocator.hpp>
#include <streamsafe/core/ipc.hpp>
#include <streamsafe/kernels/optimizers.hpp>

#include <cuda_runtime_api.h>

#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace streamsafe;

constexpr std::size_t k_bytes = std::size_t{64} << 20;
constexpr unsigned char k_first = 0x5a;   // what the producer exports
constexpr unsigned char k_second = 0xa5;  // what it writes into its next allocation

enum class round_kind : std::uint32_t { safe = 0, control_revoked = 1, plain_bytes = 2, quit = 3 };

struct round_header {
  round_kind kind = round_kind::quit;
  std::uint32_t expandable = 0;
  std::uint32_t spin_ms = 0;
  std::uint32_t padding = 0;
  std::uint64_t bytes = 0;
};

struct consumer_result {
  std::int32_t cuda_error = 0;    // cudaStreamSynchronize's result on the consumer stream
  std::int32_t import_error = 0;  // 1: import_block threw (message in the consumer's stderr)
  std::uint64_t sum = 0;
  std::uint64_t closing_after = 0;  // consumer imports still open after its reclaim
};

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void write_all(int fd, const void* p, std::size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n) {
    const ssize_t w = ::write(fd, c, n);
    if (w <= 0) throw std::runtime_error("write failed");
    c += w;
    n -= static_cast<std::size_t>(w);
  }
}

void read_all(int fd, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  while (n) {
    const ssize_t r = ::read(fd, c, n);
    if (r <= 0) throw std::runtime_error("read failed (peer gone?)");
    c += r;
    n -= static_cast<std::size_t>(r);
  }
}

std::unique_ptr<device_backend> make_backend(bool expandable) {
  if (expandable) return std::make_unique<cuda::expandable_backend>(0);
  return std::make_unique<cuda::cuda_malloc_backend>(0);
}

options make_options(bool expandable, empty_cache_mode mode) {
  options o;
  o.backend = expandable ? backend_kind::expandable : backend_kind::cuda_malloc;
  o.release_fence = fence_scope::all_streams;
  o.empty_cache = mode;
  return o;
}

// ---- consumer -----------------------------------------------------------------------------------

int consumer_main(int sock) {
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t cs = nullptr;
  check(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "cudaStreamCreate");
  unsigned long long* sum = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&sum), sizeof *sum), "cudaMalloc(sum)");
  std::unique_ptr<device_backend> backends[2] = {make_backend(false), make_backend(true)};
  std::unique_ptr<caching_allocator> allocs[2];
  for (int i = 0; i < 2; ++i)
    allocs[i] = std::make_unique<caching_allocator>(*backends[i],
                                                    make_options(i == 1, empty_cache_mode::wait));
  for (;;) {
    round_header rh;
    read_all(sock, &rh, sizeof rh);
    if (rh.kind == round_kind::quit) break;
    caching_allocator& alloc = *allocs[rh.expandable ? 1 : 0];
    ipc_handle h;
    if (rh.kind == round_kind::plain_bytes) {  // bytes only: descriptors via pidfd_getfd
      std::uint64_t n = 0;
      read_all(sock, &n, sizeof n);
      h.bytes.resize(n);
      read_all(sock, h.bytes.data(), n);
    } else {
      h = receive_ipc_handle(sock);
    }
    consumer_result res;
    imported_block imp;
    try {
      imp = alloc.import_block(h);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "consumer: import_block failed: %s\n", e.what());
      res.import_error = 1;
      std::uint64_t n = 0;
      write_all(sock, &n, sizeof n);
      write_all(sock, &res, sizeof res);
      continue;
    }
    check(cudaMemsetAsync(sum, 0, sizeof *sum, cs), "cudaMemsetAsync");
    check(kernels::launch_spin(cs, rh.spin_ms), "launch_spin");
    check(kernels::launch_read_sum(imp.ptr, rh.bytes, sum, cs), "launch_read_sum");
    const ipc_release r = alloc.release_import(imp.ptr, reinterpret_cast<stream_handle>(cs));
    const std::uint64_t n = r.bytes.size();
    write_all(sock, &n, sizeof n);
    write_all(sock, r.bytes.data(), r.bytes.size());
    const cudaError_t e = cudaStreamSynchronize(cs);
    res.cuda_error = static_cast<std::int32_t>(e);
    unsigned long long host_sum = 0;
    if (e == cudaSuccess)
      check(cudaMemcpy(&host_sum, sum, sizeof host_sum, cudaMemcpyDeviceToHost), "cudaMemcpy(sum)");
    res.sum = host_sum;
    alloc.reclaim();  // the import's event has completed: its mapping closes
    res.closing_after = alloc.ipc_status().closing + alloc.ipc_status().imports;
    write_all(sock, &res, sizeof res);
  }
  for (auto& a : allocs) a.reset();
  return 0;
}

// ---- producer -----------------------------------------------------------------------------------

struct round_report {
  bool ok = false;
  std::string text;
};

round_report run_round(int sock, round_kind kind, bool expandable, empty_cache_mode mode,
                       std::uint32_t spin_ms) {
  round_report rep;
  std::unique_ptr<device_backend> backend = make_backend(expandable);
  caching_allocator alloc(*backend, make_options(expandable, mode));
  cudaStream_t ps = nullptr;
  check(cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking), "cudaStreamCreate");
  const auto s = reinterpret_cast<stream_handle>(ps);
  void* p = alloc.allocate(k_bytes, s);
  check(kernels::launch_fill(p, k_bytes, k_first, ps), "launch_fill");
  check(cudaStreamSynchronize(ps), "cudaStreamSynchronize(fill)");
  const ipc_handle h = alloc.export_block(p);
  round_header rh;
  rh.kind = kind;
  rh.expandable = expandable ? 1 : 0;
  rh.spin_ms = spin_ms;
  rh.bytes = k_bytes;
  write_all(sock, &rh, sizeof rh);
  if (kind == round_kind::plain_bytes) {
    const std::uint64_t n = h.bytes.size();
    write_all(sock, &n, sizeof n);
    write_all(sock, h.bytes.data(), h.bytes.size());
  } else {
    send_ipc_handle(sock, h);
  }
  std::uint64_t n = 0;
  read_all(sock, &n, sizeof n);
  ipc_release r;
  r.bytes.resize(n);
  if (n) read_all(sock, r.bytes.data(), n);
  if (n == 0) {  // the consumer could not import
    consumer_result res;
    read_all(sock, &res, sizeof res);
    alloc.revoke_exports(p);
    alloc.deallocate(p);
    alloc.notify_stream_destroyed(s);
    cudaStreamDestroy(ps);
    rep.ok = kind == round_kind::plain_bytes;  // informational: pidfd_getfd may be refused here
    rep.text = "consumer could not import (see its stderr)";
    return rep;
  }
  // The consumer's read is queued behind its spin now.
  if (kind == round_kind::control_revoked) alloc.revoke_exports(p);  // the unsafe behaviour
  alloc.deallocate(p);
  const auto held = alloc.ipc_status().held_frees;
  void* q = alloc.allocate(k_bytes, s);
  check(kernels::launch_fill(q, k_bytes, k_second, ps), "launch_fill(q)");
  // The control has no export left to release, and releases nothing while the consumer reads
  // (only the reuse is under test there).
  const bool control = kind == round_kind::control_revoked;
  if (!control) alloc.notify_import_released(r);
  const auto t0 = std::chrono::steady_clock::now();
  const std::size_t released = control ? 0 : alloc.empty_cache();
  const double empty_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const auto held_after_empty = alloc.ipc_status().held_frees;
  // Churn: other sizes, frees, a second empty_cache.
  std::vector<void*> churn;
  for (int i = 0; i < 16; ++i) churn.push_back(alloc.allocate((std::size_t{1} << 20) * (i + 1), s));
  for (void* c : churn) {
    check(kernels::launch_fill(c, 1 << 20, k_second, ps), "launch_fill(churn)");
    alloc.deallocate(c);
  }
  alloc.deallocate(q);
  if (!control) alloc.empty_cache(empty_cache_mode::defer);
  consumer_result res;
  read_all(sock, &res, sizeof res);
  check(cudaStreamSynchronize(ps), "cudaStreamSynchronize(producer)");
  check(cudaGetLastError(), "producer CUDA error");
  alloc.reclaim();
  alloc.empty_cache(empty_cache_mode::wait);
  const auto st = alloc.ipc_status();
  const std::uint64_t want = static_cast<std::uint64_t>(k_bytes) * k_first;
  char line[512];
  std::snprintf(line, sizeof line,
                "reused=%s held_after_free=%zu empty_cache=%.1f ms (released %zu B, held after: "
                "%zu) consumer: cuda=%s sum=%llu (want %llu) open_after=%llu; producer exports=%zu "
                "held=%zu reserved_after=%lld",
                q == p ? "yes" : "no", held, empty_ms, released, held_after_empty,
                cudaGetErrorName(static_cast<cudaError_t>(res.cuda_error)),
                static_cast<unsigned long long>(res.sum), static_cast<unsigned long long>(want),
                static_cast<unsigned long long>(res.closing_after), st.exports, st.held_frees,
                static_cast<long long>(alloc.stats().reserved_bytes.current));
  rep.text = line;
  if (kind == round_kind::control_revoked) {
    // The hazard is real: the consumer read what the producer wrote into the reused block.
    rep.ok = q == p && (res.sum != want || res.cuda_error != 0);
  } else {
    rep.ok = res.cuda_error == 0 && res.sum == want && q != p && held == 1 && st.exports == 0 &&
             st.held_frees == 0 && res.closing_after == 0;
    if (mode == empty_cache_mode::wait) rep.ok = rep.ok && held_after_empty == 0;
    if (mode == empty_cache_mode::defer) rep.ok = rep.ok && held_after_empty == 1;
  }
  alloc.notify_stream_destroyed(s);
  cudaStreamDestroy(ps);
  return rep;
}

int producer_main(const char* self) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("streamsafe_ipc_gpu_test: skipped: no GPU present\n");
    return 0;
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    std::perror("socketpair");
    return 2;
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(sv[0]);
    const std::string fd = std::to_string(sv[1]);
    ::execl(self, self, "--consumer", fd.c_str(), static_cast<char*>(nullptr));
    std::perror("execl");
    std::_Exit(127);
  }
  ::close(sv[1]);
  const int sock = sv[0];
  // The plain-bytes round: let the consumer (our child) fetch descriptors with pidfd_getfd.
  (void)::prctl(PR_SET_PTRACER, static_cast<unsigned long>(child), 0, 0, 0);
  check(cudaSetDevice(0), "cudaSetDevice");
  struct plan {
    const char* name;
    round_kind kind;
    bool expandable;
    empty_cache_mode mode;
  };
  const plan rounds[] = {
      {"cuda_malloc, empty_cache wait", round_kind::safe, false, empty_cache_mode::wait},
      {"cuda_malloc, empty_cache defer", round_kind::safe, false, empty_cache_mode::defer},
      {"expandable, empty_cache wait", round_kind::safe, true, empty_cache_mode::wait},
      {"expandable, empty_cache defer", round_kind::safe, true, empty_cache_mode::defer},
      {"expandable, handle as plain bytes (pidfd_getfd)", round_kind::plain_bytes, true,
       empty_cache_mode::defer},
      {"control: export revoked before the free (unsafe)", round_kind::control_revoked, false,
       empty_cache_mode::defer},
  };
  int failed = 0;
  for (const plan& pl : rounds) {
    round_report rep;
    try {
      rep = run_round(sock, pl.kind, pl.expandable, pl.mode, 1500);
    } catch (const std::exception& e) {
      rep.ok = false;
      rep.text = std::string("exception: ") + e.what();
    }
    std::printf("%s: %s\n  %s\n", rep.ok ? "PASS" : "FAIL", pl.name, rep.text.c_str());
    std::fflush(stdout);
    failed += rep.ok ? 0 : 1;
    if (!rep.ok && rep.text.rfind("exception", 0) == 0) break;  // the protocol may be out of step
  }
  round_header quit;
  try {
    write_all(sock, &quit, sizeof quit);
  } catch (const std::exception&) {
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  const bool child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  std::printf("consumer exit: %s (status %d)\n", child_ok ? "ok" : "FAILED", status);
  std::printf("%s: %d round(s) failed\n", failed == 0 && child_ok ? "PASSED" : "FAILED", failed);
  return failed == 0 && child_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 3 && std::strcmp(argv[1], "--consumer") == 0)
      return consumer_main(std::atoi(argv[2]));
    return producer_main("/proc/self/exe");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argc == 3 ? "consumer" : "producer", e.what());
    return 1;
  }
}
