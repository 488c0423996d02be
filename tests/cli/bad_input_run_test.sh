#!/usr/bin/env bash
# Bad input and faults against the commands that write or read a run's
# outputs (`train`, `demo`, `report`, `inspect`, `replay`): one output
# directory per run, nothing left from a previous run, no temporary left
# behind, clear one-line errors (no C++ backtrace) and documented exit codes.
# Usage: bad_input_run_test.sh path/to/nanguard MODELS_DIR WORK_DIR  (CLI_CASE=NAME runs one case)
# (MODELS_DIR holds the models and CSV files of tests/models/make_train_models.py).
set -u
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$(realpath -- "$1")
M=$(realpath -- "$2")
WORK=$3
[ -x "$NANGUARD" ] || { echo "FAIL: no nanguard binary at '$1'"; exit 1; }
for f in linear_reg.pt norm_net.pt argmax_clf.pt no_params.pt reg.csv constant.csv; do
  [ -f "$M/$f" ] || { echo "FAIL: no '$M/$f' (build the nanguard_train_models target first)"; exit 1; }
done
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
trap 'jobs -p | xargs -r kill 2>/dev/null' EXIT  # no run of this test outlives it

train() { "$NANGUARD" train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress "$@"; }
# no_backtrace: the last output is one error line, without a C++ backtrace.
no_backtrace() {
  grep -qE "Exception raised from|frame #|c10::" <<<"$out" && fail "a C++ backtrace reached the user:
$out"
  [ "$(grep -c "nanguard: error:" <<<"$out")" -eq 1 ] || fail "expected one error line:
$out"
}
# start_long_run DIR [STEPS]: a run into DIR in the background ($long_pid), once it
# holds DIR (its pid in the lock file) and has logged a step.
start_long_run() {
  "$NANGUARD" train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --steps "${2:-1000000}" \
    --out "$1" >/dev/null 2>&1 &
  long_pid=$!
  for _ in $(seq 300); do
    [ "$(cat "$1/.nanguard.lock" 2>/dev/null)" = "$long_pid" ] && [ -s "$1/events.jsonl" ] && return 0
    sleep 0.1
  done
  fail "the background run into $1 logged nothing in 30 s"
}
# no_temporaries DIR: nothing named *.tmp-* is left under DIR.
no_temporaries() {
  local left
  left=$(find "$1" -name '*.tmp-*' -o -name '.tmp-step-*')
  [ -z "$left" ] || fail "temporaries left in $1: $left"
}

# one output directory, one run: a second run fails at once naming the first
case_one_output_directory_one_run() {
  start_long_run shared
  run 2 train --steps 20 --out shared
  expect "'shared' is the output directory of another nanguard run (pid $long_pid"
  no_backtrace
  kill -TERM "$long_pid"
  wait "$long_pid"
  rc=$?
  [ "$rc" -eq 143 ] || fail "SIGTERM during training: exit $rc, expected 143 (ended by the signal)"
  no_temporaries shared
  python3 -c "
import json, sys
for line in open('shared/events.jsonl'):
    json.loads(line)
" || fail "the interrupted run's events.jsonl is not one JSON object per line"
  # Once it has ended, the directory is free again (the lock file stays, unlocked).
  run 0 train --steps 5 --out shared
  [ -f shared/.nanguard.lock ] || fail "no lock file in shared/"
  # A lock held by a process that is not nanguard (here flock(1)) is named as far as it can be.
  flock shared/.nanguard.lock sleep 30 &
  holder=$!
  sleep 0.5
  run 2 train --steps 5 --out shared
  expect "is the output directory of another nanguard run (pid unknown"
  run 2 "$NANGUARD" demo --scenario zero-std --out shared
  expect "'shared' is the output directory of another nanguard run"
  kill "$holder"
  wait "$holder" 2>/dev/null

  # A signal during a write ends the run once the write is done, leaving no
  # temporary. To catch the run inside one, its report's temporary name is
  # made a FIFO: opening it blocks until the test reads it.
  start_long_run signalled 2000
  pid=$long_pid
  mkfifo "signalled/report.html.tmp-$pid"
  for _ in $(seq 1200); do  # until it waits in openat (syscall 257) on the FIFO
    read -r nr _ < "/proc/$pid/syscall" 2>/dev/null && [ "$nr" = 257 ] && break
    sleep 0.1
  done
  kill -TERM "$pid"
  sleep 0.5
  kill -0 "$pid" 2>/dev/null || fail "SIGTERM during a write ended the run at once"
  timeout 60 cat "signalled/report.html.tmp-$pid" > /dev/null
  wait "$pid"
  rc=$?
  [ "$rc" -eq 143 ] || fail "SIGTERM during a write: exit $rc, expected 143 (ended by the signal once written)"
  no_temporaries signalled
}

# nothing a previous run left looks like this run's output
case_nothing_left_from_a_previous_run() {
  run 3 "$NANGUARD" train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress --steps 3 \
    --batch 8 --policy abort --out reuse
  [ -d reuse/bundles ] && [ -f reuse/summary.json ] && [ -f reuse/report.html ] || fail "the abort run wrote no bundle, summary or report"
  touch reuse/summary.json.tmp-99999 reuse/report.html.tmp-99999 reuse/notes.txt
  # A killed run: only its own events.jsonl is in the directory.
  start_long_run reuse
  kill -KILL "$long_pid"
  wait "$long_pid" 2>/dev/null
  for f in summary.json report.html bundles summary.json.tmp-99999 report.html.tmp-99999; do
    [ -e "reuse/$f" ] && fail "a killed run left the previous run's reuse/$f beside its own events.jsonl"
  done
  [ -f reuse/notes.txt ] || fail "a run removed reuse/notes.txt, which no run wrote"
  # A later finite run: no bundles/ of the aborted run.
  run 0 train --steps 5 --out reuse
  [ -e reuse/bundles ] && fail "a finite run left the aborted run's reuse/bundles"
  [ "$(wc -l < reuse/events.jsonl)" -eq 5 ] || fail "reuse/events.jsonl should hold this run's 5 steps"
}

# a directory of the user's that no run held: its files of an output's name stay (#41)
case_a_directory_of_the_user_s() {
  mkdir -p mine/bundles && echo keep > mine/bundles/notes.txt && echo keep > mine/summary.json
  run 2 train --steps 3 --out mine
  expect "--out 'mine' holds 'mine/"
  expect "it is not the output directory of a nanguard run (no .nanguard.lock); pass a new or empty directory"
  no_backtrace
  [ "$(cat mine/bundles/notes.txt)" = keep ] && [ "$(cat mine/summary.json)" = keep ] || fail "train --out removed the user's files"
  [ -e mine/.nanguard.lock ] && fail "the refused run marked mine/ as a run's directory"
  mkdir -p scenarios/zero-std && echo keep > scenarios/zero-std/notes.txt
  run 2 "$NANGUARD" demo --scenario zero-std --out scenarios
  expect "--out 'scenarios' holds 'scenarios/zero-std'"
  [ -f scenarios/zero-std/notes.txt ] || fail "demo --out removed the user's scenarios/zero-std"
  # a directory with other files only is the run's, and a run after it replaces its outputs
  mkdir other && echo keep > other/notes.txt
  run 0 train --steps 3 --out other
  run 0 train --steps 3 --out other
  [ -f other/notes.txt ] && [ -f other/summary.json ] || fail "a run into other/ lost notes.txt or wrote no summary.json"
}

# paths that are not UTF-8 (Latin-1 names): the JSON outputs hold U+FFFD for them (#41)
case_paths_that_are_not_utf8() {
  local data res
  data=$(printf 'donn\xe9es.csv') res=$(printf 'r\xe9s')
  cp "$M/reg.csv" "$data"
  run 0 "$NANGUARD" train --model "$M/linear_reg.pt" --data "$data" --target y --task regress --steps 3 --out "$res"
  [ -f "$res/summary.json" ] || fail "no summary.json in the run's --out"
  grep -qF 'donn'$'\xef\xbf\xbd''es.csv' "$res/summary.json" || fail "summary.json does not name the data file"
  run 0 "$NANGUARD" report "$res/events.jsonl" -o latin1.html
  printf 'a,b\xe9\n1,2\n3,4\n5,6\n' > latin1.csv
  run 0 "$NANGUARD" scan latin1.csv --json
  expect '"b'$'\xef\xbf\xbd''"'
}

# an output that is one of the inputs
case_an_output_that_is_an_input() {
  cp "$M/linear_reg.pt" model.pt
  run 2 "$NANGUARD" train --model model.pt --data "$M/reg.csv" --target y --task regress --out model.pt
  expect "--out 'model.pt' is the --model file; pass a new directory for --out"
  mkdir -p inputs/bundles && cp "$M/reg.csv" inputs/bundles/reg.csv
  run 2 "$NANGUARD" train --model "$M/linear_reg.pt" --data inputs/bundles/reg.csv --target y --task regress --out inputs
  expect "--data 'inputs/bundles/reg.csv' is in 'inputs/bundles', which this run replaces"
  [ -f inputs/bundles/reg.csv ] || fail "the refused run removed its input"
}

# models that cannot be trained: one clear line, exit 2, no output directory
case_models_that_cannot_be_trained() {
  run 2 "$NANGUARD" train --model "$M/argmax_clf.pt" --data "$M/reg.csv" --target y --task regress --out int_out
  expect "the model returns Long values, but the loss must be a floating-point tensor that depends on the model's trainable parameters"
  no_backtrace
  run 2 "$NANGUARD" train --model "$M/no_params.pt" --data "$M/reg.csv" --target y --task regress --out no_params
  expect "the model's output depends on no trainable parameter"
  expect "the loss must be a floating-point tensor that depends on the model's trainable parameters"
  no_backtrace
  [ -e int_out ] || [ -e no_params ] && fail "a refused model left an output directory"
  run 2 "$NANGUARD" train --model "$M" --data "$M/reg.csv" --target y --task regress
  expect "'$M' is a directory, not a TorchScript model"
  run 2 bash -c 'cat "$2" | "$1" train --model /dev/stdin --data "$3" --target y --task regress' - \
    "$NANGUARD" "$M/linear_reg.pt" "$M/reg.csv"
  expect "'/dev/stdin' is not a regular file (a pipe or a device?): a TorchScript model is a zip archive read by seeking"
  run 2 "$NANGUARD" train --model missing.pt --data "$M/reg.csv" --target y --task regress
  expect "cannot open model 'missing.pt': no such file"
}

# truncated or corrupt bundle files: one line naming the file, exit 2
case_corrupt_bundle_files() {
  B=reuse_bundle/bundles/step-000001
  run 3 "$NANGUARD" train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress --steps 3 \
    --batch 8 --policy abort --out reuse_bundle
  for f in batch.pt parameters.pt; do
    cp -r "$B" "cut_$f"
    head -c "$(( $(stat -c %s "$B/$f") / 2 ))" "$B/$f" > "cut_$f/$f"
    run 2 "$NANGUARD" inspect "cut_$f"
    expect "cut_$f/$f' is truncated or corrupt"
    no_backtrace
    run 2 "$NANGUARD" replay "cut_$f" --model "$M/norm_net.pt"
    expect "cut_$f/$f' is truncated or corrupt"
    no_backtrace
  done
  cp -r "$B" bad_meta
  sed -i 's/"step": 1,/"step": "one",/' bad_meta/meta.json
  run 2 "$NANGUARD" inspect bad_meta
  expect "bad_meta/meta.json': 'step' should be"
  no_backtrace

  # A wrong-typed event line: named with its file and line
  echo '{"step": "one", "action": "step"}' > typed.jsonl
  run 2 "$NANGUARD" report typed.jsonl -o typed.html
  expect "typed.jsonl:1: not a step event: nanguard::step_event_from_json:"
  no_backtrace
}

# a full disk (a file size limit: writes fail with EFBIG) while writing the report
# (the run's log of 3 steps fits in 8 KiB, its report does not)
case_a_full_disk() {
  limited() { bash -c 'ulimit -f 8; trap "" XFSZ; exec "$@"' limited "$@"; }
  run 2 limited "$NANGUARD" train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress \
    --steps 3 --out full
  expect "cannot write 'full/report.html': File too large"
  no_backtrace
  no_temporaries full
  # the event log itself (1 KiB: a few steps' lines), which the guard writes
  tiny() { bash -c 'ulimit -f 1; trap "" XFSZ; exec "$@"' tiny "$@"; }
  run 2 tiny "$NANGUARD" train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress \
    --steps 20 --out full_log
  expect "nanguard::event_log: writing to 'full_log/events.jsonl' failed: File too large; is the disk full?"
  expect "the log ends with the whole line before its event"
  no_backtrace
  [ -z "$(tail -c 1 full_log/events.jsonl)" ] || fail "full_log/events.jsonl ends in half a line"
  run 0 "$NANGUARD" report full_log/events.jsonl -o full_log.html
  run 2 tiny "$NANGUARD" demo --scenario zero-std --out full_demo  # exit 2 as train, not 1 (#41)
  expect "nanguard::event_log: writing to 'full_demo/zero-std/unguarded/events.jsonl' failed: File too large"
  no_backtrace
  run 2 limited "$NANGUARD" report full/events.jsonl -o full.html
  expect "cannot write 'full.html': File too large"
  no_backtrace
  [ -e full.html ] && fail "a failed report write left full.html"
  no_temporaries .
  mkdir -p a_dir
  run 2 "$NANGUARD" report full/events.jsonl -o a_dir
  expect "cannot write 'a_dir': it exists and is not a regular file"
}

# a word that is no command is named, with the commands (#41)
case_an_unknown_command() {
  run 2 "$NANGUARD" frobnicate --steps 3
  expect "nanguard: error: no command 'frobnicate'; the commands are demo, census, launch, scan, clean, advise, report, train, inspect, replay; see nanguard --help"
  run 2 "$NANGUARD"
  expect "A subcommand is required"
}

# every command documents the same exit codes in its --help
case_exit_codes_in_help() {
  for cmd in demo census launch scan clean advise report train inspect replay; do
    run 0 "$NANGUARD" "$cmd" --help
    expect "Exit codes: 0 "
    expect "2 bad input or usage"
    expect "1 an internal error (a bug: please report it)."
  done
}

run_cases one_output_directory_one_run \
  nothing_left_from_a_previous_run \
  an_output_that_is_an_input \
  models_that_cannot_be_trained \
  corrupt_bundle_files \
  a_full_disk \
  a_directory_of_the_user_s \
  paths_that_are_not_utf8 \
  an_unknown_command \
  exit_codes_in_help
if [ "$failures" -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "bad_input_run: all checks passed"
