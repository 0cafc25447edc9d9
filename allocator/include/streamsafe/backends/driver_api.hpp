// streamsafe: the CUDA driver API calls streamsafe needs (virtual memory management and error
// names), reached at run time through cudaGetDriverEntryPointByVersion instead of linking
// libcuda, so that binaries start on machines without a driver (there, load() says why the
// calls are unavailable).
//
// The wrappers take and return exactly what the cu* functions do. Include <cuda.h> for the
// types only; never call a cu* function directly.
//
// Thread safety: the entry points are fetched once, on first use, inside a function-local
// static (thread-safe initialisation, nothing runs at static-init time); after that every call
// is a plain call through a pointer and may come from any thread.
#pragma once

#include <cuda.h>

#include <cstddef>

namespace streamsafe::cuda::driver {

// Fetches the entry points (first call only). Throws streamsafe::backend_error naming the
// symbol and the runtime error when the driver is missing or too old.
void load();
// True when the entry points are available (fetches them on the first call). Never throws.
bool available() noexcept;

// cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap, cuMemSetAccess, cuMemGetAccess,
// cuMemAddressReserve, cuMemAddressFree, cuMemGetAllocationGranularity. Each returns
// CUDA_ERROR_NOT_INITIALIZED when the entry points could not be loaded.
CUresult mem_create(CUmemGenericAllocationHandle* handle, std::size_t size,
                    const CUmemAllocationProp* prop, unsigned long long flags) noexcept;
CUresult mem_release(CUmemGenericAllocationHandle handle) noexcept;
CUresult mem_map(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                 CUmemGenericAllocationHandle handle, unsigned long long flags) noexcept;
CUresult mem_unmap(CUdeviceptr ptr, std::size_t size) noexcept;
CUresult mem_set_access(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc,
                        std::size_t count) noexcept;
CUresult mem_get_access(unsigned long long* flags, const CUmemLocation* location,
                        CUdeviceptr ptr) noexcept;
CUresult mem_address_reserve(CUdeviceptr* ptr, std::size_t size, std::size_t alignment,
                             CUdeviceptr addr, unsigned long long flags) noexcept;
CUresult mem_address_free(CUdeviceptr ptr, std::size_t size) noexcept;
CUresult mem_get_allocation_granularity(std::size_t* granularity, const CUmemAllocationProp* prop,
                                        CUmemAllocationGranularity_flags option) noexcept;
// cuMemExportToShareableHandle, cuMemImportFromShareableHandle (IPC of expandable segments).
CUresult mem_export_to_shareable_handle(void* shareable_handle, CUmemGenericAllocationHandle handle,
                                        CUmemAllocationHandleType type,
                                        unsigned long long flags) noexcept;
CUresult mem_import_from_shareable_handle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                          CUmemAllocationHandleType type) noexcept;

// cuEventRecord, cuEventQuery, cuStreamWaitEvent: the event calls of the allocator's
// cross-stream path, through the driver because the runtime's wrappers cost more (on the H200,
// driver 580: cudaEventQuery of a completed event 328 ns, cuEventQuery 232 ns;
// bench/driver_floor_bench.cpp). CUDA_ERROR_INVALID_CONTEXT where the calling thread has no
// current context yet (the runtime binds one lazily): callers then use the runtime call.
CUresult event_record(CUevent event, CUstream stream) noexcept;
CUresult event_query(CUevent event) noexcept;
CUresult stream_wait_event(CUstream stream, CUevent event, unsigned int flags) noexcept;
// cuCtxGetCurrent: the calling thread's current context (a thread-local read in the driver).
CUresult ctx_get_current(CUcontext* context) noexcept;

// cuGetErrorName / cuGetErrorString ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"); a fixed
// fallback text when the driver cannot name the code. Never null.
const char* error_name(CUresult result) noexcept;
const char* error_string(CUresult result) noexcept;

}  // namespace streamsafe::cuda::driver
