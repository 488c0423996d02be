# check.sh — what the CLI test scripts share; source it, then call run,
# expect and fail, and exit non-zero when $failures > 0.
#   source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"

failures=0
current_case=""
fail() { echo "FAIL${current_case:+ [$current_case]}: $*"; failures=$((failures + 1)); }

# run EXPECTED_RC CMD...: runs, keeps stdout+stderr in $out, checks the exit code.
run() {
  local want=$1; shift
  out=$("$@" 2>&1); local rc=$?
  [ "$rc" -eq "$want" ] || fail "'$*' exited $rc, expected $want; output:
$out"
}
expect() { grep -qF -- "$1" <<<"$out" || fail "expected '$1' in the output of the last command:
$out"; }

# Cases: a script defines a function case_NAME per case and ends with
# `run_cases NAME...` (in the order they run). CTest registers each case as
# a test of its own (tests/CMakeLists.txt: nanguard_add_cli_cases), which sets
# CLI_CASE=NAME: then only that case runs. Without CLI_CASE, all of them.
run_cases() {
  if [ -n "${CLI_CASE:-}" ] && ! declare -F "case_$CLI_CASE" >/dev/null; then
    fail "no case '$CLI_CASE' in $0 (cases: $*)"
    return
  fi
  local c
  for c in "$@"; do
    [ -z "${CLI_CASE:-}" ] || [ "$CLI_CASE" = "$c" ] || continue
    current_case=$c
    "case_$c"
  done
  current_case=""
}
