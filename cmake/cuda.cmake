# The CUDA kernels (src/detail/census_cuda.cu): built when NANGUARD_CUDA is
# ON, or AUTO (the default) and the torch found is a CUDA build whose CMake
# config found nvcc (torch 2.x's config enables the CUDA language itself).
# Include before find_package(Torch); call nanguard_enable_cuda() once the
# nanguard target exists. It sets NANGUARD_WITH_CUDA.
#
# One architecture by default: each one is a full device compile, and CI
# builds on 2 cores. Torch's config turns TORCH_CUDA_ARCH_LIST into -gencode
# flags in CMAKE_CUDA_FLAGS (with no GPU to detect, a list starting at sm_50,
# which nvcc 13 rejects), and sets CMAKE_CUDA_ARCHITECTURES to OFF. The
# kernels' list is NANGUARD_CUDA_ARCHITECTURES instead, "90": real sm_90
# code (H100/H200) plus compute_90 PTX, which newer GPUs compile at load.
set(NANGUARD_CUDA AUTO CACHE STRING "Build the CUDA kernels: AUTO (when torch is a CUDA build and nvcc is found), ON or OFF")
set_property(CACHE NANGUARD_CUDA PROPERTY STRINGS AUTO ON OFF)
set(NANGUARD_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures of nanguard's kernels (CUDA_ARCHITECTURES syntax)")
# Spares torch's config its GPU probe (it compiles and runs a program).
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST 9.0)
endif()

macro(nanguard_enable_cuda)
  set(NANGUARD_WITH_CUDA OFF)
  if(NOT NANGUARD_CUDA STREQUAL "OFF")
    if(NOT CMAKE_CUDA_COMPILER)
      include(CheckLanguage)
      check_language(CUDA)
    endif()
    if(CAFFE2_USE_CUDA AND CMAKE_CUDA_COMPILER)
      enable_language(CUDA)
      set(NANGUARD_WITH_CUDA ON)
    elseif(NANGUARD_CUDA STREQUAL "ON")
      message(FATAL_ERROR "nanguard: NANGUARD_CUDA=ON, but the torch found (${Torch_DIR}) has "
        "CAFFE2_USE_CUDA='${CAFFE2_USE_CUDA}' and nvcc is '${CMAKE_CUDA_COMPILER}'. Build against a CUDA "
        "build of torch with the CUDA toolkit installed (nvcc on PATH or CUDACXX set), or pass "
        "-DNANGUARD_CUDA=AUTO to build for the CPU only.")
    endif()
  endif()
  message(STATUS "nanguard: CUDA kernels ${NANGUARD_WITH_CUDA} (NANGUARD_CUDA=${NANGUARD_CUDA}, "
    "architectures ${NANGUARD_CUDA_ARCHITECTURES})")
  if(NANGUARD_WITH_CUDA)
    string(REGEX REPLACE "-gencode[ =]arch=[^ ]+" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")
    # Free of LibTorch's headers (raw pointers, sizes, a stream): nvcc
    # compiles it in seconds. Its objects go into libnanguard; the CUDA
    # runtime comes with torch's libraries.
    add_library(nanguard_cuda_kernels OBJECT src/detail/census_cuda.cu)
    set_target_properties(nanguard_cuda_kernels PROPERTIES
      CUDA_ARCHITECTURES "${NANGUARD_CUDA_ARCHITECTURES}"
      CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON
      POSITION_INDEPENDENT_CODE ON)
    target_compile_options(nanguard_cuda_kernels PRIVATE -Xcompiler=-Wall)
    target_sources(nanguard PRIVATE src/detail/cuda_record.cpp $<TARGET_OBJECTS:nanguard_cuda_kernels>)
    target_compile_definitions(nanguard PRIVATE NANGUARD_WITH_CUDA)
  endif()
endmacro()
