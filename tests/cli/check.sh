# check.sh — what the CLI test scripts share; source it, then call run,
# expect and fail, and exit non-zero when $failures > 0.
#   source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# run EXPECTED_RC CMD...: runs, keeps stdout+stderr in $out, checks the exit code.
run() {
  local want=$1; shift
  out=$("$@" 2>&1); local rc=$?
  [ "$rc" -eq "$want" ] || fail "'$*' exited $rc, expected $want; output:
$out"
}
expect() { grep -qF -- "$1" <<<"$out" || fail "expected '$1' in the output of the last command:
$out"; }
