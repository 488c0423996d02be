# Finds LibTorch in the torch package of Python3_EXECUTABLE's environment
# (torch.utils.cmake_prefix_path), unless Torch_DIR names one already.
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
if(NOT Torch_DIR)
  list(APPEND CMAKE_PREFIX_PATH "${NANGUARD_PYTHON_TORCH_PREFIX}")
endif()
