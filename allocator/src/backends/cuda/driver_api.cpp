// streamsafe: the driver API entry points, fetched once at run time through
// cudaGetDriverEntryPointByVersion (no link against libcuda). See driver_api.hpp.
//
// Thread safety: the table is a function-local static, initialised once by whichever thread
// comes first (C++11 guarantees the others wait); it is read-only afterwards.
#include <streamsafe/backends/driver_api.hpp>
#include <streamsafe/core/errors.hpp>

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

namespace streamsafe::cuda::driver {
namespace {

// The ABI version we ask for. Every entry point used here has kept its signature since CUDA
// 10.2 (VMM) or 6.0 (error names), so the 12.0 ABI works with any driver a CUDA 13 runtime
// accepts.
constexpr unsigned int entry_point_version = 12000;

struct entry_points {
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemGetAccess_v10020 mem_get_access = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuEventRecord_v2000 event_record = nullptr;
  PFN_cuEventQuery_v2000 event_query = nullptr;
  PFN_cuStreamWaitEvent_v3020 stream_wait_event = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
  std::string error;  // empty when every entry point was found
};

// Fetches one symbol; on failure records why (first failure only) and leaves fn null.
template <typename Function>
void fetch(const char* symbol, Function& fn, std::string& error) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t result = cudaGetDriverEntryPointByVersion(symbol, &address, entry_point_version,
                                                              cudaEnableDefault, &status);
  if (result != cudaSuccess || status != cudaDriverEntryPointSuccess || address == nullptr) {
    (void)cudaGetLastError();
    if (error.empty()) {
      error = "streamsafe: cannot load the CUDA driver entry point ";
      error += symbol;
      error += " (version ";
      error += std::to_string(entry_point_version);
      error += "): ";
      if (result != cudaSuccess) {
        error += cudaGetErrorName(result);
        error += " (";
        error += cudaGetErrorString(result);
        error += ")";
      } else if (status == cudaDriverEntryPointVersionNotSufficent) {
        error += "the driver is too old";
      } else {
        error += "symbol not found";
      }
    }
    return;
  }
  // Object pointer to function pointer: copy the bits (the platform ABI makes them the same).
  static_assert(sizeof(fn) == sizeof(address), "function and object pointers differ in size");
  std::memcpy(&fn, &address, sizeof(fn));
}

entry_points load_entry_points() noexcept {
  entry_points table;
  try {
    fetch("cuMemCreate", table.mem_create, table.error);
    fetch("cuMemRelease", table.mem_release, table.error);
    fetch("cuMemMap", table.mem_map, table.error);
    fetch("cuMemUnmap", table.mem_unmap, table.error);
    fetch("cuMemSetAccess", table.mem_set_access, table.error);
    fetch("cuMemGetAccess", table.mem_get_access, table.error);
    fetch("cuMemAddressReserve", table.mem_address_reserve, table.error);
    fetch("cuMemAddressFree", table.mem_address_free, table.error);
    fetch("cuMemGetAllocationGranularity", table.mem_get_allocation_granularity, table.error);
    fetch("cuMemExportToShareableHandle", table.mem_export_to_shareable_handle, table.error);
    fetch("cuMemImportFromShareableHandle", table.mem_import_from_shareable_handle, table.error);
    fetch("cuGetErrorName", table.get_error_name, table.error);
    fetch("cuGetErrorString", table.get_error_string, table.error);
    fetch("cuEventRecord", table.event_record, table.error);
    fetch("cuEventQuery", table.event_query, table.error);
    fetch("cuStreamWaitEvent", table.stream_wait_event, table.error);
    fetch("cuCtxGetCurrent", table.ctx_get_current, table.error);
  } catch (...) {  // std::bad_alloc building the message
    if (table.error.empty()) table.error = "streamsafe: cannot load the CUDA driver entry points";
  }
  return table;
}

const entry_points& table() noexcept {
  static const entry_points loaded = load_entry_points();
  return loaded;
}

// The VMM calls are usable only when every entry point was found.
const entry_points* usable() noexcept {
  const entry_points& t = table();
  return t.error.empty() ? &t : nullptr;
}

}  // namespace

void load() {
  const entry_points& t = table();
  if (!t.error.empty()) throw backend_error(t.error);
}

bool available() noexcept { return usable() != nullptr; }

CUresult mem_create(CUmemGenericAllocationHandle* handle, std::size_t size,
                    const CUmemAllocationProp* prop, unsigned long long flags) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_create(handle, size, prop, flags) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult event_record(CUevent event, CUstream stream) noexcept {
  const entry_points* t = usable();
  return t ? t->event_record(event, stream) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult event_query(CUevent event) noexcept {
  const entry_points* t = usable();
  return t ? t->event_query(event) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult stream_wait_event(CUstream stream, CUevent event, unsigned int flags) noexcept {
  const entry_points* t = usable();
  return t ? t->stream_wait_event(stream, event, flags) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult ctx_get_current(CUcontext* context) noexcept {
  const entry_points* t = usable();
  return t ? t->ctx_get_current(context) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_release(CUmemGenericAllocationHandle handle) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_release(handle) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_map(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                 CUmemGenericAllocationHandle handle, unsigned long long flags) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_map(ptr, size, offset, handle, flags) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_unmap(CUdeviceptr ptr, std::size_t size) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_unmap(ptr, size) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_set_access(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc,
                        std::size_t count) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_set_access(ptr, size, desc, count) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_get_access(unsigned long long* flags, const CUmemLocation* location,
                        CUdeviceptr ptr) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_get_access(flags, location, ptr) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_address_reserve(CUdeviceptr* ptr, std::size_t size, std::size_t alignment,
                             CUdeviceptr addr, unsigned long long flags) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_address_reserve(ptr, size, alignment, addr, flags) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_address_free(CUdeviceptr ptr, std::size_t size) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_address_free(ptr, size) : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_get_allocation_granularity(std::size_t* granularity, const CUmemAllocationProp* prop,
                                        CUmemAllocationGranularity_flags option) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_get_allocation_granularity(granularity, prop, option)
           : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_export_to_shareable_handle(void* shareable_handle, CUmemGenericAllocationHandle handle,
                                        CUmemAllocationHandleType type,
                                        unsigned long long flags) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_export_to_shareable_handle(shareable_handle, handle, type, flags)
           : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult mem_import_from_shareable_handle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                          CUmemAllocationHandleType type) noexcept {
  const entry_points* t = usable();
  return t ? t->mem_import_from_shareable_handle(handle, os_handle, type)
           : CUDA_ERROR_NOT_INITIALIZED;
}

const char* error_name(CUresult result) noexcept {
  const entry_points& t = table();
  const char* name = nullptr;
  if (t.get_error_name == nullptr || t.get_error_name(result, &name) != CUDA_SUCCESS ||
      name == nullptr) {
    switch (result) {  // the codes the wrappers return themselves when nothing is loaded
      case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
      case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
      default: return "CUDA driver error (unnamed)";
    }
  }
  return name;
}

const char* error_string(CUresult result) noexcept {
  const entry_points& t = table();
  const char* text = nullptr;
  if (t.get_error_string == nullptr || t.get_error_string(result, &text) != CUDA_SUCCESS ||
      text == nullptr) {
    return result == CUDA_ERROR_NOT_INITIALIZED ? "driver API not initialised or not loaded"
                                                : "no description available";
  }
  return text;
}

}  // namespace streamsafe::cuda::driver
