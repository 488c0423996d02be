# `pip install .` as a Python user runs it, into a scratch virtual
# environment that sees the folder holding PYTHON's torch (a .pth file),
# then check_installed.py from another folder, with nothing on PYTHONPATH.
include(${CMAKE_CURRENT_LIST_DIR}/../../../cmake/run_or_fail.cmake)
file(REMOVE_RECURSE ${VENV})
run_or_fail("pip install test" ${PYTHON} -m venv ${VENV})
execute_process(COMMAND ${PYTHON} -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"
  OUTPUT_VARIABLE torch_site OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${VENV}/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
  OUTPUT_VARIABLE site OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
file(WRITE ${site}/torch_env.pth "${torch_site}\n")
run_or_fail("pip install test" ${CMAKE_COMMAND} -E env --unset=PYTHONPATH
  ${VENV}/bin/python -m pip install --quiet --progress-bar off ${SOURCE_DIR})
run_or_fail("pip install test" ${CMAKE_COMMAND} -E chdir ${VENV}
  ${CMAKE_COMMAND} -E env --unset=PYTHONPATH ${VENV}/bin/python ${CHECK} ${site})
