# Points find_package(Torch) at the LibTorch inside the torch package of
# Python3_EXECUTABLE's environment (torch.utils.cmake_prefix_path): the
# module is imported next to that torch and the tests' models are written by
# it, so no other LibTorch would do. A new Python replaces a cached Torch_DIR.
#
# -E: under `pip install .`, pip's isolated build environment hides the
# environment's packages through PYTHON* variables; the interpreter itself
# still belongs to the environment being installed into, so ignoring those
# variables finds the torch the module will be imported with.
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -E -c "import torch; print(torch.utils.cmake_prefix_path)"
  RESULT_VARIABLE _nanguard_torch_rc
  OUTPUT_VARIABLE NANGUARD_PYTHON_TORCH_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE
  ERROR_VARIABLE _nanguard_torch_error)
if(NOT _nanguard_torch_rc EQUAL 0)
  message(FATAL_ERROR "nanguard: 'import torch' fails in ${Python3_EXECUTABLE}:\n${_nanguard_torch_error}\n"
    "Install torch there (make setup does: scripts/setup-python), pass "
    "-DPython3_EXECUTABLE=<the python of the environment holding torch>, or configure with "
    "-DNANGUARD_BUILD_TESTS=OFF -DNANGUARD_BUILD_PYTHON=OFF and Torch_DIR set.")
endif()
set(_nanguard_torch_dir "${NANGUARD_PYTHON_TORCH_PREFIX}/Torch")
if(DEFINED CACHE{Torch_DIR} AND NOT Torch_DIR STREQUAL _nanguard_torch_dir)
  # Another environment: forget the libraries LibTorch's config found in the
  # old one (find_library keeps a cached path even once it is gone).
  get_filename_component(_nanguard_old_torch "${Torch_DIR}/../../.." ABSOLUTE)
  get_cmake_property(_nanguard_cached CACHE_VARIABLES)
  foreach(_v IN LISTS _nanguard_cached)
    get_property(_value CACHE ${_v} PROPERTY VALUE)
    string(FIND "${_value}" "${_nanguard_old_torch}/" _at)
    if(_at EQUAL 0)
      unset(${_v} CACHE)
    endif()
  endforeach()
endif()
set(Torch_DIR "${_nanguard_torch_dir}" CACHE PATH
  "LibTorch's CMake config, from the torch of Python3_EXECUTABLE" FORCE)
