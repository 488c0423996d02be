# Installs the Python component of the build tree into a scratch prefix and
# runs check_installed.py with only that prefix's package on PYTHONPATH.
include(${CMAKE_CURRENT_LIST_DIR}/../../../cmake/run_or_fail.cmake)
file(REMOVE_RECURSE ${PREFIX})
run_or_fail("python install test" ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${PREFIX} --component python)
run_or_fail("python install test"
    ${CMAKE_COMMAND} -E env PYTHONPATH=${PREFIX}/${SITE} ${PYTHON} ${CHECK} ${PREFIX}/${SITE})
