#!/usr/bin/env bash
# `nanguard report LOG --tensorboard DIR` end to end: the event logs of a
# `nanguard demo` scenario (a run that aborts on a traced NaN, and its guarded
# remedy) become TensorBoard event files, read back with tensorboard's own
# EventAccumulator; then a data event, and the bad directories.
#   usage: tensorboard_cli_test.sh NANGUARD PYTHON OUT  (CLI_CASE=NAME runs one case)
set -uo pipefail
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$1
PYTHON=$2
OUT=$3
rm -rf "$OUT"
mkdir -p "$OUT"
cd "$OUT" || exit 1

# tags DIR: "TAG COUNT LAST" per scalar tag and "text TAG COUNT" per text tag,
# as tensorboard's EventAccumulator reads the event file in DIR.
tags() {
  "$PYTHON" - "$1" <<'EOF'
import sys, warnings
warnings.filterwarnings("ignore")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, TENSORS
acc = EventAccumulator(sys.argv[1], size_guidance={TENSORS: 0})
acc.Reload()
for tag in sorted(acc.Tags()["scalars"]):
    ev = acc.Scalars(tag)
    print(tag, len(ev), ev[-1].step, ev[-1].value)
for tag in sorted(acc.Tags()["tensors"]):
    ev = acc.Tensors(tag)
    print("text", tag, len(ev), ev[-1].step, ev[-1].tensor_proto.string_val[0].decode()[:200].replace("\n", " | "))
EOF
}

case_demo_logs() {
  run 0 "$NANGUARD" demo --scenario log-softmax --out demo
  local bad=demo/log-softmax/unguarded/events.jsonl good=demo/log-softmax/remedy/events.jsonl
  local steps
  steps=$(grep -c . "$bad")
  run 0 "$NANGUARD" report "$bad" --tensorboard tb1
  expect "wrote tb1/events.out.tfevents."
  [ -e report.html ] && fail "--tensorboard alone wrote an HTML page"
  run 0 tags tb1
  expect "loss $steps $steps "
  expect "skipped $steps $steps 1.0"
  for t in grad_norm lr loss_scale clip_coef; do expect "$t $steps $steps"; done
  grep -q "^grad_norm/" <<<"$out" || fail "no per-parameter norm (grad_norm/<name>) in:
$out"
  expect "text nanguard/findings 1 $steps **step $steps: abort**"
  expect " forward aten::log in loss: producer"
  # Two logs (and the page too): one run directory each, named as the report names them.
  run 0 "$NANGUARD" report "$bad" "$good" -o report.html --tensorboard tb2
  expect "wrote report.html"
  [ -d tb2/unguarded ] && [ -d tb2/remedy ] || fail "expected tb2/unguarded and tb2/remedy, got: $(ls tb2)"
  run 0 tags tb2/remedy
  steps=$(grep -c . "$good")
  expect "loss $steps $steps"
  expect "skipped $steps $steps 0.0"
}

case_data_event() {
  cat >mixed.jsonl <<'EOF'
{"step": 1, "action": "data", "data": {"source": "firewall_collate", "checked": 32, "dropped": 2, "nan": 3}}
{"step": 1, "loss": 0.5, "grad_norm": 1.5, "lr": 0.1, "scale": 1, "skipped": false, "action": "step", "top_norms": [{"name": "fc.weight", "norm": 1.25}]}
EOF
  run 0 "$NANGUARD" report mixed.jsonl --tensorboard tb -o mixed.html
  run 0 tags tb
  expect "data/checked 1 1 32.0"
  expect "data/dropped 1 1 2.0"
  expect "data/nan 1 1 3.0"
  expect "loss 1 1 0.5"
  expect "grad_norm/fc.weight 1 1 1.25"
  grep -q "firewall_collate: 32 rows checked, 2 dropped" mixed.html || fail "the page does not show the data event"
}

case_bad_dirs() {
  printf '{"step": 1, "action": "step"}\n' >ok.jsonl
  : >afile
  run 2 "$NANGUARD" report ok.jsonl --tensorboard afile
  expect "'afile' is a file, not a directory"
  run 2 "$NANGUARD" report ok.jsonl --tensorboard afile/sub
  expect "cannot create the directory 'afile/sub'"
  run 2 "$NANGUARD" report ok.jsonl
  expect "nothing to write: pass -o report.html"
  run 2 "$NANGUARD" report missing.jsonl --tensorboard tb_none
  expect "missing.jsonl"
  [ -e tb_none ] && fail "a missing log still made the TensorBoard directory"
}

run_cases demo_logs data_event bad_dirs
exit $((failures > 0))
