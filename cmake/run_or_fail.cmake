# run_or_fail(<what> <command> [args...]): for cmake -P test scripts. Runs the
# command and prints its output; stops the script with `<what>: ...failed`,
# the exit code and the output when it fails.
function(run_or_fail what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what}: `${ARGN}` failed (${rc}):\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()
