# Installs the build tree into a scratch prefix, then configures, builds and
# runs tests/package against it with find_package(nanguard), on the torch
# nanguard was built with (TORCH_DIR).
include(${SOURCE_DIR}/cmake/run_or_fail.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
run_or_fail("packaging test" ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix)
run_or_fail("packaging test" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package -B ${WORK_DIR}/build
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${TORCH_DIR})
run_or_fail("packaging test" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run_or_fail("packaging test" ${WORK_DIR}/build/consumer)
