# The CUDA layers of the allocator (included by allocator/CMakeLists.txt when CUDA is on).

# streamsafe_backends_cuda: the CUDA backends. Links the CUDA runtime only; the driver API (VMM)
# is reached at run time through cudaGetDriverEntryPointByVersion, so binaries start on machines
# without a driver.
file(GLOB STREAMSAFE_BACKENDS_CUDA_SOURCES CONFIGURE_DEPENDS src/backends/cuda/*.cpp)
add_library(streamsafe_backends_cuda STATIC ${STREAMSAFE_BACKENDS_CUDA_SOURCES})
target_link_libraries(streamsafe_backends_cuda PUBLIC streamsafe_core CUDA::cudart
                      PRIVATE $<BUILD_INTERFACE:streamsafe_internal> $<BUILD_INTERFACE:streamsafe_warnings>)
set_target_properties(streamsafe_backends_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON)
add_library(streamsafe::backends_cuda ALIAS streamsafe_backends_cuda)

# streamsafe_frontend_cxx: streamsafe::cuda::allocator, the multi-device C++ front end. The
# CUB-style and cuda::mr adapters are header-only (include/streamsafe/frontends/cub_allocator.hpp,
# memory_resource.hpp).
file(GLOB STREAMSAFE_FRONTEND_CXX_SOURCES CONFIGURE_DEPENDS src/frontends/cxx/*.cpp)
add_library(streamsafe_frontend_cxx STATIC ${STREAMSAFE_FRONTEND_CXX_SOURCES})
target_link_libraries(streamsafe_frontend_cxx PUBLIC streamsafe_backends_cuda
                      PRIVATE $<BUILD_INTERFACE:streamsafe_internal> $<BUILD_INTERFACE:streamsafe_warnings>)
set_target_properties(streamsafe_frontend_cxx PROPERTIES POSITION_INDEPENDENT_CODE ON)
add_library(streamsafe::frontend_cxx ALIAS streamsafe_frontend_cxx)

add_library(streamsafe INTERFACE)
target_link_libraries(streamsafe INTERFACE streamsafe_core streamsafe_sim streamsafe_backends_cuda
                      streamsafe_frontend_cxx)
add_library(streamsafe::streamsafe ALIAS streamsafe)

# ---- drop-in front ends (docs/drop-in.md) -------------------------------------------------------
# The shared front ends each carry their own copy of the static libraries, hidden (hidden
# visibility, --exclude-libs, and a version script exporting only the given patterns) so that
# they never clash with a program's own copy. Installed, they find libcudart through their RPATH.
function(streamsafe_frontend_library target exported)
  set(script "${CMAKE_CURRENT_BINARY_DIR}/${target}.map")
  file(WRITE "${script}" "{\n  global: ${exported};\n  local: *;\n};\n")
  set_target_properties(${target} PROPERTIES
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    LINK_DEPENDS "${script}"
    INSTALL_RPATH "${CUDAToolkit_LIBRARY_DIR}")
  target_link_options(${target} PRIVATE "LINKER:--exclude-libs,ALL" "LINKER:--no-undefined"
                      "LINKER:--version-script=${script}")
  target_link_libraries(${target} PRIVATE streamsafe_frontend_cxx ${CMAKE_DL_LIBS}
                        $<BUILD_INTERFACE:streamsafe_internal> $<BUILD_INTERFACE:streamsafe_warnings>)
endfunction()

# streamsafe_c: the C API (include/streamsafe/streamsafe.h), libstreamsafe_c.so. Shared, so that
# C programs link it without a C++ linker; it also carries the simulated device for
# streamsafe_use_simulated_devices.
file(GLOB STREAMSAFE_CAPI_SOURCES CONFIGURE_DEPENDS src/frontends/capi/*.cpp)
add_library(streamsafe_c SHARED ${STREAMSAFE_CAPI_SOURCES})
target_include_directories(streamsafe_c PUBLIC
  $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:include>)
streamsafe_frontend_library(streamsafe_c "streamsafe_*")
target_link_libraries(streamsafe_c PRIVATE streamsafe_sim)
set_target_properties(streamsafe_c PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION 0 EXPORT_NAME c)
add_library(streamsafe::c ALIAS streamsafe_c)

# streamsafe_cccl: what code including streamsafe/frontends/memory_resource.hpp needs: CCCL's
# headers (CUDA 13 ships them under include/cccl) and the experimental memory-resource switch.
add_library(streamsafe_cccl INTERFACE)
foreach(dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
  if(EXISTS "${dir}/cccl/cuda/memory_resource")
    target_include_directories(streamsafe_cccl SYSTEM INTERFACE "${dir}/cccl")
    break()
  endif()
endforeach()
target_compile_definitions(streamsafe_cccl INTERFACE LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE)
target_link_libraries(streamsafe_cccl INTERFACE streamsafe_frontend_cxx)
set_target_properties(streamsafe_cccl PROPERTIES EXPORT_NAME cccl)
add_library(streamsafe::cccl ALIAS streamsafe_cccl)

# streamsafe_preload: libstreamsafe_preload.so, the cudaMalloc/cudaFree interposer (LD_PRELOAD)
# for programs linked against the shared CUDA runtime (src/frontends/preload/ says what it serves
# and how).
file(GLOB STREAMSAFE_PRELOAD_SOURCES CONFIGURE_DEPENDS src/frontends/preload/*.cpp)
add_library(streamsafe_preload SHARED ${STREAMSAFE_PRELOAD_SOURCES})
streamsafe_frontend_library(streamsafe_preload "cuda*; streamsafe_*")
set_target_properties(streamsafe_preload PROPERTIES EXPORT_NAME preload)
add_library(streamsafe::preload ALIAS streamsafe_preload)

# streamsafe_torch: libstreamsafe_torch.so, the alloc/free pair PyTorch's CUDAPluggableAllocator
# loads, with ctypes-callable empty_cache, statistics and record_stream (src/frontends/torch/).
add_library(streamsafe_torch SHARED src/frontends/torch/torch_allocator.cpp)
streamsafe_frontend_library(streamsafe_torch "streamsafe_torch_*")
set_target_properties(streamsafe_torch PROPERTIES EXPORT_NAME torch)
add_library(streamsafe::torch ALIAS streamsafe_torch)
