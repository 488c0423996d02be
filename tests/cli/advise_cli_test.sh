#!/usr/bin/env bash
# CLI test of `nanguard advise`: advice, verification, JSON, exit codes and
# bad input. Usage: advise_cli_test.sh path/to/nanguard MODELS_DIR WORK_DIR
# (CLI_CASE=NAME runs one case)
# (MODELS_DIR holds the TorchScript models of tests/models/make_models.py).
set -u
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$(realpath -- "$1")
MODELS=$(realpath -- "$2")
WORK=$3
[ -x "$NANGUARD" ] || { echo "FAIL: no nanguard binary at '$1'"; exit 1; }
if [ ! -f "$MODELS/fp16_net.pt" ] || [ ! -f "$MODELS/clf_net.pt" ] || [ ! -f "$MODELS/norm_net.pt" ]; then
  echo "FAIL: no TorchScript test models in '$2' (build the precision_test target first)"; exit 1
fi
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1

# 4 features, a class label y in {0, 1, 2}; row 7 has a missing value.
awk 'BEGIN { srand(3); print "a,b,c,d,y";
  for (i = 0; i < 120; i++) {
    a = sprintf("%.4f", rand() * 4 - 2); if (i == 7) a = "";
    printf "%s,%.4f,%.4f,%.4f,%d\n", a, rand() * 4 - 2, rand() * 4 - 2, rand() * 4 - 2, i % 3 } }' > data.csv
# Every feature constant: norm_net divides by a zero std in float32.
awk 'BEGIN { print "a,b,c,d,y"; for (i = 0; i < 16; i++) print "1,2,3,4," i % 2 }' > constant.csv

# The model with one module (blow, x * 1e5) beyond fp16's range.
case_a_module_beyond_fp16() {
  run 0 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data data.csv --target y --steps 2 --batch 16
  expect "2 steps of 16 rows from data.csv (119 rows, 1 with missing or non-finite values dropped), task regress"
  expect "bf16 is safe"
  expect "keep these modules in fp32: blow ("
  expect "fp16 needs a loss scale in ["
  expect "ops whose values overflow fp16:"
  expect "aten::mul"
  expect "emulated fp16 (every op output rounded): NON-FINITE; modules that went non-finite: blow (first: aten::mul in blow)"
  expect "emulated fp16 keeping blow in fp32: finite"
  expect "bf16 CPU autocast: finite"
  expect "advice confirmed"
  grep -E '^  lin +[0-9]+ +0 ' <<<"$out" >/dev/null || fail "lin should have no fp16 overflow:
  $out"
}

# --json: the advice as JSON.
case_json_output() {
  run 0 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data data.csv --target y --json
  expect '"keep_fp32": ['
  if command -v python3 >/dev/null; then
    python3 -c '
import json, sys
r = json.load(sys.stdin)
assert r["keep_fp32"] == ["blow"], r["keep_fp32"]
assert r["bf16_safe"] is True
assert r["steps"] == 3 and r["rows"] == 119 and r["rows_dropped"] == 1
v = r["verification"]
assert v["fp16_nonfinite_modules"] == ["blow"] and v["confirmed"] is True, v
assert v["fp16_with_keep_fp32_finite"] and v["bf16_autocast_finite"] and not v["fp16_finite"], v
blow = [m for m in r["modules"] if m["module"] == "blow"][0]
assert blow["keep_fp32"] and blow["forward"]["fp16_overflow"] > 0, blow
assert {g["parameter"] for g in r["gradients"]} == {"lin.weight", "lin.bias", "head.weight", "head.bias"}
assert r["loss_scale"]["fits"] and r["loss_scale"]["min"] <= r["loss_scale"]["max"], r["loss_scale"]
' <<<"$out" || fail "advise --json is not the expected JSON:
  $out"
  fi
}

# A classifier in range: bf16 and plain fp16 are fine.
case_a_classifier_in_range() {
  run 0 "$NANGUARD" advise --model "$MODELS/clf_net.pt" --data data.csv --target y --task classify
  expect "task classify"
  expect "bf16 is safe"
  expect "fp16 forward is in range"
  expect "modules that went non-finite: none"
  expect "advice confirmed"
}

# Already non-finite in float32: exit 3, and said first.
case_already_nonfinite_in_float32() {
  run 3 "$NANGUARD" advise --model "$MODELS/norm_net.pt" --data constant.csv --target y
  expect "the model already makes NaN/Inf in float32 (first: aten::div (forward) in norm)"
}

# Bad input: exit 2 with one clear line.
case_bad_input() {
  run 2 "$NANGUARD" advise --model nope.pt --data data.csv --target y
  expect "nanguard: error: cannot open model 'nope.pt': no such file"
  run 2 "$NANGUARD" advise --model data.csv --data data.csv --target y
  expect "'data.csv' is not a TorchScript model"
  run 2 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data missing.csv --target y
  expect "nanguard: error:"
  expect "missing.csv"
  run 2 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data data.csv --target label
  expect "nanguard: error: no column 'label' in 'data.csv'; its columns are: a, b, c, d, y"
  run 2 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data data.csv --target y --task classify
  expect "--task classify needs integer class labels in [0, 1)"
  run 2 "$NANGUARD" advise --model "$MODELS/clf_net.pt" --data data.csv --target y --task regress
  expect "--task regress needs one output per row; the model returned shape [32, 3] for 32 rows"
  run 2 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data data.csv --target y --steps 0
  expect "--steps: must be an integer in [1, 1000000000], got 0"
  run 2 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data data.csv --target y --task cluster
  run 2 "$NANGUARD" advise --model "$MODELS/fp16_net.pt" --data data.csv
  expect "--target is required"
}

run_cases a_module_beyond_fp16 \
  json_output \
  a_classifier_in_range \
  already_nonfinite_in_float32 \
  bad_input
if [ "$failures" -gt 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "all advise CLI checks passed"
