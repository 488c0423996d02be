# Installs the Python component of the build tree into a scratch prefix and
# runs check_installed.py with only that prefix's package on PYTHONPATH.
file(REMOVE_RECURSE ${PREFIX})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "python install test: `${ARGN}` failed (${rc}):\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()
run(${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${PREFIX} --component python)
run(${CMAKE_COMMAND} -E env PYTHONPATH=${PREFIX}/${SITE} ${PYTHON} ${CHECK} ${PREFIX}/${SITE})
