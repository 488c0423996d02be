# Builds and runs the consumer project in tests/package against nanguard,
# on the torch nanguard was built with (TORCH_DIR). MODE find_package
# installs the build tree into a scratch prefix first; MODE add_subdirectory
# builds nanguard from SOURCE_DIR inside the consumer, with no build type
# (nanguard must not choose one there; unoptimised, it also compiles faster).
# PREFIX_PATH is the build's CMAKE_PREFIX_PATH with "|" between entries.
include(${SOURCE_DIR}/cmake/run_or_fail.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
string(REPLACE "|" ";" prefix_path "${PREFIX_PATH}")
if(MODE STREQUAL "find_package")
  list(PREPEND prefix_path ${WORK_DIR}/prefix)
endif()
# A list crosses into the consumer's configure through an initial cache file.
file(WRITE ${WORK_DIR}/init.cmake "set(CMAKE_PREFIX_PATH \"${prefix_path}\" CACHE STRING \"\")\n")
set(common -C ${WORK_DIR}/init.cmake -DTorch_DIR=${TORCH_DIR} -DEXPECTED_NANGUARD_VERSION=${VERSION})
if(MODE STREQUAL "find_package")
  run_or_fail("packaging test" ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix)
  run_or_fail("packaging test" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package -B ${WORK_DIR}/build -G Ninja
    -DCMAKE_BUILD_TYPE=Release ${common})
elseif(MODE STREQUAL "add_subdirectory")
  run_or_fail("packaging test" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package -B ${WORK_DIR}/build -G Ninja
    -DNANGUARD_SOURCE_DIR=${SOURCE_DIR} -DNANGUARD_GLOO_INCLUDE_DIR=${GLOO_INCLUDE_DIR} ${common})
else()
  message(FATAL_ERROR "run_packaging_test.cmake: MODE must be find_package or add_subdirectory, got '${MODE}'")
endif()
run_or_fail("packaging test" ${CMAKE_COMMAND} --build ${WORK_DIR}/build --target consumer)
run_or_fail("packaging test" ${WORK_DIR}/build/consumer)
