# The CUDA kernels (src/census/census_cuda.cu): built when NANGUARD_CUDA is
# ON, or AUTO (the default) and the torch found is a CUDA build whose CMake
# config found nvcc (torch 2.x's config enables the CUDA language itself).
# Include before find_package(Torch); call nanguard_enable_cuda() once the
# nanguard target exists. It sets NANGUARD_WITH_CUDA.
#
# The kernels' architectures are NANGUARD_CUDA_ARCHITECTURES (CMake's
# CUDA_ARCHITECTURES syntax). By default those torch's own CUDA 13 wheel
# carries (torch._C._cuda_getArchFlags(): 75 80 86 90 100 120) and 89 (L4,
# RTX 40xx), as real code, plus compute_120 PTX that a newer GPU compiles at
# load: census_cuda.cu is one small file, so seven device compiles take
# seconds. Override it with -DNANGUARD_CUDA_ARCHITECTURES=..., or the
# environment variable NANGUARD_CUDA_ARCHITECTURES (what `pip install .`
# passes on), or CMake's own CUDAARCHS, when the cache is made. (Torch's
# config turns TORCH_CUDA_ARCH_LIST into -gencode flags in CMAKE_CUDA_FLAGS,
# which nanguard_enable_cuda removes, and sets CMAKE_CUDA_ARCHITECTURES OFF.)
set(NANGUARD_DEFAULT_CUDA_ARCHITECTURES "75-real;80-real;86-real;89-real;90-real;100-real;120")
# (Not CMAKE_CUDA_ARCHITECTURES: enable_language(CUDA) caches nvcc's own
# default there, 75, which a later configure could not tell from a choice.)
if(DEFINED ENV{NANGUARD_CUDA_ARCHITECTURES})
  set(_nanguard_archs "$ENV{NANGUARD_CUDA_ARCHITECTURES}")
elseif(DEFINED ENV{CUDAARCHS})
  set(_nanguard_archs "$ENV{CUDAARCHS}")
else()
  set(_nanguard_archs "${NANGUARD_DEFAULT_CUDA_ARCHITECTURES}")
endif()
# A cache made before the list grew holds the old default, "90": let it go.
get_property(_nanguard_archs_help CACHE NANGUARD_CUDA_ARCHITECTURES PROPERTY HELPSTRING)
if(_nanguard_archs_help STREQUAL "CUDA architectures of nanguard's kernels (CUDA_ARCHITECTURES syntax)")
  unset(NANGUARD_CUDA_ARCHITECTURES CACHE)
endif()
set(NANGUARD_CUDA_ARCHITECTURES "${_nanguard_archs}" CACHE STRING
  "CUDA architectures of nanguard's kernels (CUDA_ARCHITECTURES syntax; default: torch's wheel's, see cmake/cuda.cmake)")
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
    add_library(nanguard_cuda_kernels OBJECT src/census/census_cuda.cu)
    set_target_properties(nanguard_cuda_kernels PROPERTIES
      CUDA_ARCHITECTURES "${NANGUARD_CUDA_ARCHITECTURES}"
      CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON
      POSITION_INDEPENDENT_CODE ON)
    target_compile_options(nanguard_cuda_kernels PRIVATE -Xcompiler=-Wall)
    target_include_directories(nanguard_cuda_kernels PRIVATE ${PROJECT_SOURCE_DIR}/include)  # float_formats.h
    target_sources(nanguard PRIVATE src/census/cuda_record.cpp $<TARGET_OBJECTS:nanguard_cuda_kernels>)
    target_compile_definitions(nanguard PRIVATE NANGUARD_WITH_CUDA)
  endif()
endmacro()
