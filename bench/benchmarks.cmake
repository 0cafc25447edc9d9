# streamsafe benchmark suite (included by bench/CMakeLists.txt, which globs *_bench.cpp into
# STREAMSAFE_BENCH_SOURCES). docs/benchmarks.md describes the scenarios and how to run them.
#
#   streamsafe_bench       every scenario (1-6) against every allocator on device 0: streamsafe
#                          (cuda_malloc and expandable backends), cudaMalloc, the cudaMallocAsync
#                          default pool, cub::CachingDeviceAllocator and, when PyTorch is found,
#                          PyTorch's c10 caching allocator. Plain C++ (g++), links the CUDA runtime;
#                          CUB's CachingDeviceAllocator is header-only host code and compiles with g++.
#   streamsafe_bench_sim   scenarios 1-3 and 6 on the simulated device: the allocator's bookkeeping
#                          alone, no CUDA runtime call, no GPU needed (CI runs it as a smoke test).
#   streamsafe_bench_c10   (optional) the one translation unit that includes PyTorch headers, built
#                          with PyTorch's _GLIBCXX_USE_CXX11_ABI and C++20.
#
# STREAMSAFE_BENCH_TORCH: AUTO (default: the c10 baseline when PyTorch is found), ON (required),
# OFF. PyTorch is looked up through Python (STREAMSAFE_BENCH_PYTHON, default python3): its
# torch/include, torch/lib/libc10.so and libc10_cuda.so, torch._C._GLIBCXX_USE_CXX11_ABI and
# torch.__version__. STREAMSAFE_BENCH_TORCH_DIR (the directory of torch/__init__.py) skips Python.
# find_package(Torch) is not used: it configures all of libtorch and its CUDA dependencies, of
# which the baseline needs two libraries and the headers.

set(STREAMSAFE_BENCH_TORCH AUTO CACHE STRING "Build the PyTorch c10 baseline: AUTO, ON or OFF")
set_property(CACHE STREAMSAFE_BENCH_TORCH PROPERTY STRINGS AUTO ON OFF)
set(STREAMSAFE_BENCH_TORCH_DIR "" CACHE PATH "Directory of the torch Python package (found with Python when empty)")
set(STREAMSAFE_BENCH_PYTHON "" CACHE FILEPATH "Python used to find PyTorch (python3 on PATH when empty)")

# Google Benchmark runs benchmarks in registration order, which is the link order of the
# translation units: put the scenarios in their numbered order, then any other *_bench.cpp.
set(_ssb_sources)
foreach(_ssb_name same_stream_pair random_allocations threads driver_floor cross_stream empty_cache replay)
  list(APPEND _ssb_sources ${CMAKE_CURRENT_SOURCE_DIR}/${_ssb_name}_bench.cpp)
endforeach()
foreach(_ssb_file IN LISTS STREAMSAFE_BENCH_SOURCES)
  get_filename_component(_ssb_file "${_ssb_file}" ABSOLUTE)
  if(NOT _ssb_file IN_LIST _ssb_sources)
    list(APPEND _ssb_sources ${_ssb_file})
  endif()
endforeach()
list(APPEND _ssb_sources ${CMAKE_CURRENT_SOURCE_DIR}/bench_main.cpp)

set(_ssb_common_definitions
  STREAMSAFE_BENCH_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
  STREAMSAFE_BENCH_VERSION="${PROJECT_VERSION}"
  STREAMSAFE_BENCH_BUILD_TYPE="$<CONFIG>")

# ---- the simulated-device suite -----------------------------------------------------------------
add_executable(streamsafe_bench_sim ${_ssb_sources})
target_include_directories(streamsafe_bench_sim PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_definitions(streamsafe_bench_sim PRIVATE STREAMSAFE_BENCH_SIM=1 ${_ssb_common_definitions})
target_link_libraries(streamsafe_bench_sim PRIVATE streamsafe::sim benchmark::benchmark streamsafe_warnings)

# ---- the host's own thread scaling (no allocator, no CUDA): the reference for scenario 3 ---------
add_executable(host_scaling_probe host_scaling_probe.cpp)
target_link_libraries(host_scaling_probe PRIVATE Threads::Threads streamsafe_warnings)

# ---- the GPU suite ------------------------------------------------------------------------------
if(NOT STREAMSAFE_CUDA)
  message(STATUS "streamsafe: CUDA off: streamsafe_bench (the GPU suite) is skipped")
  return()
endif()
find_path(STREAMSAFE_BENCH_CUB_INCLUDE_DIR cub/util_allocator.cuh
  HINTS ${CUDAToolkit_INCLUDE_DIRS}/cccl ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT}/include/cccl
  NO_DEFAULT_PATH)
if(NOT STREAMSAFE_BENCH_CUB_INCLUDE_DIR)
  message(FATAL_ERROR "streamsafe_bench: cub/util_allocator.cuh not found under ${CUDAToolkit_INCLUDE_DIRS} (CCCL)")
endif()

add_executable(streamsafe_bench ${_ssb_sources})
target_include_directories(streamsafe_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_include_directories(streamsafe_bench SYSTEM PRIVATE ${STREAMSAFE_BENCH_CUB_INCLUDE_DIR})
target_compile_definitions(streamsafe_bench PRIVATE ${_ssb_common_definitions})
target_link_libraries(streamsafe_bench PRIVATE
  streamsafe::streamsafe streamsafe_kernels benchmark::benchmark CUDA::cudart streamsafe_warnings)

# ---- the driver's virtual memory calls per chunk size (no allocator): docs/observability.md ------
add_executable(vmm_chunk_probe vmm_chunk_probe.cpp)
target_link_libraries(vmm_chunk_probe PRIVATE CUDA::cuda_driver streamsafe_warnings)

# ---- optional: PyTorch's c10 caching allocator ----------------------------------------------------
set(_ssb_torch_found FALSE)
if(NOT STREAMSAFE_BENCH_TORCH STREQUAL "OFF")
  set(_ssb_torch_dir "${STREAMSAFE_BENCH_TORCH_DIR}")
  set(_ssb_torch_abi "")
  set(_ssb_torch_version "")
  set(_ssb_python "${STREAMSAFE_BENCH_PYTHON}")
  if(NOT _ssb_python)
    find_program(_ssb_python_found NAMES python3 python)
    set(_ssb_python "${_ssb_python_found}")
  endif()
  if(_ssb_python)
    execute_process(
      COMMAND "${_ssb_python}" -c
        "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
      OUTPUT_VARIABLE _ssb_torch_out ERROR_VARIABLE _ssb_torch_err RESULT_VARIABLE _ssb_torch_rc
      OUTPUT_STRIP_TRAILING_WHITESPACE TIMEOUT 120)
    if(_ssb_torch_rc EQUAL 0)
      string(REPLACE "\n" ";" _ssb_torch_lines "${_ssb_torch_out}")
      list(LENGTH _ssb_torch_lines _ssb_n)
      if(_ssb_n GREATER_EQUAL 3)
        list(GET _ssb_torch_lines -3 _ssb_dir_from_python)
        list(GET _ssb_torch_lines -2 _ssb_torch_abi)
        list(GET _ssb_torch_lines -1 _ssb_torch_version)
        if(NOT _ssb_torch_dir)
          set(_ssb_torch_dir "${_ssb_dir_from_python}")
        endif()
      endif()
    endif()
  endif()
  if(_ssb_torch_dir)
    find_path(STREAMSAFE_BENCH_C10_INCLUDE_DIR c10/cuda/CUDACachingAllocator.h
      HINTS "${_ssb_torch_dir}/include" NO_DEFAULT_PATH)
    find_library(STREAMSAFE_BENCH_C10_CUDA_LIBRARY c10_cuda HINTS "${_ssb_torch_dir}/lib" NO_DEFAULT_PATH)
    find_library(STREAMSAFE_BENCH_C10_LIBRARY c10 HINTS "${_ssb_torch_dir}/lib" NO_DEFAULT_PATH)
    if(STREAMSAFE_BENCH_C10_INCLUDE_DIR AND STREAMSAFE_BENCH_C10_CUDA_LIBRARY AND STREAMSAFE_BENCH_C10_LIBRARY)
      set(_ssb_torch_found TRUE)
    endif()
  endif()
  if(_ssb_torch_found)
    if(_ssb_torch_abi STREQUAL "")
      set(_ssb_torch_abi 1)  # PyTorch 2.7+ wheels use the C++11 ABI
    endif()
    if(_ssb_torch_version STREQUAL "")
      set(_ssb_torch_version "unknown")
    endif()
    message(STATUS "streamsafe_bench: PyTorch ${_ssb_torch_version} at ${_ssb_torch_dir} "
                   "(_GLIBCXX_USE_CXX11_ABI=${_ssb_torch_abi}): c10 caching allocator baseline ON")
    add_library(streamsafe_bench_c10 STATIC ${CMAKE_CURRENT_SOURCE_DIR}/c10_baseline.cpp)
    # C++20: PyTorch's headers are moving to it; the ABI flag only reaches this translation unit,
    # whose interface (c10_baseline.hpp) passes no standard-library type.
    set_target_properties(streamsafe_bench_c10 PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON
                                                         POSITION_INDEPENDENT_CODE ON)
    target_include_directories(streamsafe_bench_c10 SYSTEM PRIVATE "${STREAMSAFE_BENCH_C10_INCLUDE_DIR}")
    target_compile_definitions(streamsafe_bench_c10 PRIVATE
      _GLIBCXX_USE_CXX11_ABI=${_ssb_torch_abi}
      STREAMSAFE_BENCH_TORCH_VERSION="${_ssb_torch_version}")
    target_link_libraries(streamsafe_bench_c10
      PUBLIC ${STREAMSAFE_BENCH_C10_CUDA_LIBRARY} ${STREAMSAFE_BENCH_C10_LIBRARY} CUDA::cudart
      PRIVATE streamsafe_warnings)
    target_link_libraries(streamsafe_bench PRIVATE streamsafe_bench_c10)
    target_compile_definitions(streamsafe_bench PRIVATE STREAMSAFE_BENCH_HAVE_C10=1)
  elseif(STREAMSAFE_BENCH_TORCH STREQUAL "ON")
    message(FATAL_ERROR "streamsafe_bench: STREAMSAFE_BENCH_TORCH=ON but PyTorch was not found "
                        "(python: '${_ssb_python}', torch dir: '${_ssb_torch_dir}', ${_ssb_torch_err})")
  else()
    message(STATUS "streamsafe_bench: PyTorch not found: no c10 baseline (STREAMSAFE_BENCH_TORCH=AUTO)")
  endif()
endif()
if(NOT _ssb_torch_found)
  target_compile_definitions(streamsafe_bench PRIVATE STREAMSAFE_BENCH_HAVE_C10=0)
endif()
