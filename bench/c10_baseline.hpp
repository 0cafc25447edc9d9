// streamsafe benchmarks: PyTorch's c10 CUDA caching allocator as a baseline.
//
// These functions are defined in c10_baseline.cpp, the one translation unit that includes
// PyTorch headers. It is compiled into its own library with PyTorch's flags
// (-D_GLIBCXX_USE_CXX11_ABI as torch._C._GLIBCXX_USE_CXX11_ABI says, C++20), so only types
// whose layout is the same under both libstdc++ ABIs cross this header: pointers, integers,
// char buffers. Built only when CMake finds PyTorch (STREAMSAFE_BENCH_TORCH); the macro
// STREAMSAFE_BENCH_HAVE_C10 tells the suite.
//
// Streams are cudaStream_t values passed as void*. Thread safety: as c10's allocator (every call
// may come from any thread); the "owned" blocks are per thread (a thread frees what it allocated).
#pragma once

#include <cstddef>
#include <cstdint>

namespace streamsafe_bench::c10_baseline {

// Initialises c10's allocator for every device (CUDACachingAllocator::init) unless PyTorch has
// already done it. Returns false and writes a message into why[0..why_size) on failure.
bool initialize(char* why, std::size_t why_size) noexcept;
// The PyTorch version the library was built against ("2.11.0+cu130").
const char* torch_version() noexcept;

// CUDACachingAllocator::raw_alloc_with_stream / raw_delete: the hot path. Throw std::exception
// (c10::Error) on failure.
void* allocate(std::size_t bytes, void* stream);
void deallocate(void* ptr);

// The Tensor path, for record_stream: a c10::DataPtr allocated with `stream` as the current
// stream (what PyTorch does under `with torch.cuda.stream(s)`), kept by this thread until
// deallocate_owned drops it. record_stream calls CUDACachingAllocator::recordStream on it.
void* allocate_owned(std::size_t bytes, void* stream);
void record_stream(void* ptr, void* stream);
void deallocate_owned(void* ptr);

// emptyCache(), and the aggregate reserved-bytes statistic of the current device.
void empty_cache();
void reset_peak_reserved();
std::int64_t peak_reserved_bytes();
std::int64_t reserved_bytes();

}  // namespace streamsafe_bench::c10_baseline
