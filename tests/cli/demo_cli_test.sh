#!/usr/bin/env bash
# CLI test of `nanguard demo`: every scenario goes non-finite without its
# remedy (the tracer names the expected op) and trains to a finite, falling
# loss with it; the event logs, a repro bundle and report.html are written;
# --scenario, --list, a bad scenario name, and --device cuda (refused
# without a GPU).
# Usage: demo_cli_test.sh path/to/nanguard WORK_DIR  (CLI_CASE=NAME runs one case)
set -u
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$(realpath -- "$1")
WORK=$2
[ -x "$NANGUARD" ] || { echo "FAIL: no nanguard binary at '$1'"; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
# expect_row NAME OP MODULE DIRECTION ROLE CAUSE REMEDY: the scenario's summary row, status ok
# (the finding's diagnosis is CAUSE, and its remedy replayed on the failing step kept it finite).
expect_row() {
  grep -qE "^  $1 +$2 +$3 +$4 +[0-9]+ +$5 +$6 +$7 +finite +[0-9.e+-]+ +ok\$" <<<"$out" ||
    fail "expected the summary row '$1 $2 $3 $4 <step> $5 $6 $7 finite <loss> ok' in:
$out"
}

SCENARIOS="zero-std lr-too-high bad-data log-softmax fp16-overflow masked-attention"

# The whole demo, its files, then one scenario into the same directory.
case_the_demo() {
  run 0 "$NANGUARD" demo --list
  for s in $SCENARIOS; do expect "$s"; done

  # The whole demo.
  run 0 "$NANGUARD" demo --out demo
  demo_out=$out
  expect "nanguard demo: 6 scenarios"
  expect_row zero-std 'aten::div' norm forward producer division_by_zero 'standardize \(eps\)'
  expect_row lr-too-high 'aten::mse_loss' loss forward producer divergence 'clip \+ warmup'
  expect_row bad-data 'aten::addmm' fc1 forward input bad_data firewall
  expect_row log-softmax 'aten::log' loss forward producer log_of_nonpositive cross_entropy
  expect_row fp16-overflow 'aten::_to_copy' fc2 backward producer precision_range 'loss scaling'
  expect_row masked-attention 'aten::_softmax' attn forward producer fully_masked_softmax masked_softmax
  expect "every remedy trained to a finite, falling loss"
  grep -qE "in [0-9.]+ s \([0-9]+ threads\)" <<<"$out" || fail "no time taken at the end:
$out"
  # Each scenario block shows the tracer's finding, its diagnosis and the remedy's losses.
  [ "$(grep -c 'the tracer.s first finding' <<<"$out")" -eq 6 ] || fail "expected 6 findings in:
$out"
  [ "$(grep -cE '^    \|   remedy: +[a-z]' <<<"$out")" -eq 6 ] || fail "expected 6 diagnosed remedies in:
$out"
  expect "log_of_nonpositive (high confidence)"
  # Each finding's remedy, replayed on its step, kept it finite.
  [ "$(grep -cE '^    \|   verified: +verified finite: ' <<<"$out")" -eq 6 ] || fail "expected 6 verified remedies in:
$out"
  expect "verified finite: lr x0.5 for 6 steps on this batch from step 0's weights"
  [ "$(grep -cE 'loss [0-9.e+-]+ -> [0-9.e+-]+: finite, falling' <<<"$out")" -eq 7 ] ||
    fail "expected 7 remedy runs (6 + rollback) finite and falling in:
$out"
  expect "firewall: 4 rows dropped (NaN/Inf), 4 outlier values clipped"
  expect "rollback: "
  grep -qE '[1-9][0-9]* rollbacks?' <<<"$out" || fail "the rollback run did not roll back:
$out"
  grep -qE '[1-9][0-9]* skipped, loss scale 65536 -> ' <<<"$out" || fail "the loss scale did not back off:
$out"

  # Files: an event log per run, the unguarded one ending on the NaN/Inf.
  for s in $SCENARIOS; do
    for r in unguarded remedy; do
      [ -s "demo/$s/$r/events.jsonl" ] || fail "no event log demo/$s/$r/events.jsonl"
    done
    tail -n 1 "demo/$s/unguarded/events.jsonl" | grep -q '"action":"abort"' ||
      fail "demo/$s/unguarded/events.jsonl does not end on the abort"
    tail -n 1 "demo/$s/unguarded/events.jsonl" | grep -q '"findings":\[{' ||
      fail "demo/$s/unguarded/events.jsonl has no finding"
  done
  [ -s demo/lr-too-high/rollback/events.jsonl ] || fail "no event log of the rollback run"
  grep -q '"action":"rollback"' demo/lr-too-high/rollback/events.jsonl || fail "no rollback event logged"
  bundle=$(find demo -name meta.json | head -n 1)
  [ -n "$bundle" ] || fail "no repro bundle (meta.json) under demo/"
  [ -n "$bundle" ] && { grep -q '"policy"' "$bundle" || fail "$bundle has no policy"; }
  grep -qF "repro bundle: " <<<"$demo_out" || fail "the bundle's path is not printed"
  [ -s demo/report.html ] || fail "no demo/report.html"
  grep -q 'zero-std/unguarded' demo/report.html || fail "report.html does not name the runs"

  # One scenario: the directory holds this run only (another scenario's folder
  # left by the previous run would look like this run's).
  run 0 "$NANGUARD" demo --scenario log-softmax --out demo
  expect "nanguard demo: 1 scenario,"
  expect_row log-softmax 'aten::log' loss forward producer log_of_nonpositive cross_entropy
  grep -q "zero-std" <<<"$out" && fail "--scenario log-softmax ran zero-std too:
$out"
  [ -s demo/log-softmax/remedy/events.jsonl ] || fail "no event log after --scenario"
  [ -e demo/zero-std ] && fail "--scenario left the previous run's zero-std folder"
}

# Piped (stdout buffered), the guard's lines on stderr still come after
# the demo's output that preceded them: under the scenario they belong to.
case_guard_lines_in_order() {
  run 0 "$NANGUARD" demo --scenario masked-attention --out ordered
  local header guard_line
  header=$(grep -nF "[1/1] masked-attention" <<<"$out" | cut -d: -f1)
  guard_line=$(grep -nF "nanguard: step 1: nan from aten::_softmax in attn" <<<"$out" | cut -d: -f1)
  [ -n "$header" ] && [ -n "$guard_line" ] && [ "$guard_line" -gt "$header" ] ||
    fail "the guard's line (line ${guard_line:-none}) came before the scenario's header (line ${header:-none}):
$out"
}

# Bad usage: exit 2, one line naming what and how to fix it.
case_bad_usage() {
  run 2 "$NANGUARD" demo --scenario nope --out demo
  expect "no scenario 'nope'; choose one of: zero-std, lr-too-high, bad-data, log-softmax, fp16-overflow, masked-attention"
  touch afile
  run 2 "$NANGUARD" demo --scenario zero-std --out afile/sub
  expect "cannot create the output directory 'afile/sub'"
}

# --device cuda: on a GPU, a scenario whose finding needs the forward pass
# and one whose finding is in the backward pass, named as on the CPU; without
# a GPU, a clear refusal.
case_on_cuda() {
  out=$("$NANGUARD" demo --device cuda --scenario masked-attention --out demo 2>&1); rc=$?
  if [ "$rc" -eq 2 ]; then
    expect "--device cuda: no CUDA device found (torch sees none); run the demo with --device cpu"
    [ -e demo ] && fail "the refused demo made its output directory"
  else
    [ "$rc" -eq 0 ] || fail "--device cuda exited $rc, expected 0 (a GPU) or 2 (none); output:
$out"
    expect "(on cuda)"
    expect_row masked-attention 'aten::_softmax' attn forward producer fully_masked_softmax masked_softmax
    run 0 "$NANGUARD" demo --device cuda --scenario fp16-overflow --out demo
    expect_row fp16-overflow 'aten::_to_copy' fc2 backward producer precision_range 'loss scaling'
  fi
  run 2 "$NANGUARD" demo --device tpu --list
  expect "tpu"
}

run_cases the_demo guard_lines_in_order bad_usage on_cuda

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "demo_cli: all checks passed"
