#!/usr/bin/env bash
# CLI test of `nanguard train`, `nanguard inspect` and `nanguard replay`:
# summary.json, exit codes, bundles and bad input.
# Usage: train_cli_test.sh path/to/nanguard MODELS_DIR WORK_DIR  (CLI_CASE=NAME runs one case)
# (MODELS_DIR holds the models and CSV files of tests/models/make_train_models.py).
set -u
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$(realpath -- "$1")
MODELS=$(realpath -- "$2")
WORK=$3
[ -x "$NANGUARD" ] || { echo "FAIL: no nanguard binary at '$1'"; exit 1; }
for f in mlp_clf.pt linear_reg.pt norm_net.pt norm_net_eps.pt sqrt_net.pt masked_sqrt_net.pt \
         reg.csv reg_nan.csv big.csv clf.csv constant.csv wide.csv; do
  [ -f "$MODELS/$f" ] || { echo "FAIL: no '$MODELS/$f' (build the nanguard_train_models target first)"; exit 1; }
done
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
# summary DIR PYTHON: asserts on DIR/summary.json, loaded as `s`.
summary() {
  python3 -c "
import json, sys
s = json.load(open(sys.argv[1] + '/summary.json'))
f = s['first_nonfinite']
$2
" "$1" || fail "summary.json of $1 does not hold what was expected:
$(cat "$1/summary.json" 2>/dev/null)"
}
train() { "$NANGUARD" train "$@"; }
M=$MODELS

# a finite run: a classifier with nested modules
case_a_finite_run() {
  run 0 train --model "$M/mlp_clf.pt" --data "$M/clf.csv" --target y --task classify --steps 60 --batch 16 \
    --lr 0.01 --warmup 10 --clip 0.3 --out finite
  expect "nanguard train: finite"
  expect "steps: 60 of 60; final loss"
  expect "train step 60/60"  # the progress lines (stderr is not a TTY here)
  summary finite "
assert s['status'] == 'finite' and s['steps'] == 60 and f is None, s
assert isinstance(s['final_loss'], float) and s['final_loss'] < 1.0, s['final_loss']
assert s['data'] == {'rows': 90, 'rows_dropped': 0, 'rows_repaired': 0, 'firewall': 'off'}, s['data']"
  python3 -c "
import json, sys
ev = [json.loads(l) for l in open('finite/events.jsonl')]
assert len(ev) == 60 and ev[0]['step'] == 1 and ev[-1]['step'] == 60, len(ev)
names = {t['name'] for e in ev for t in e['top_norms']}
assert 'encoder.layers.0.weight' in names, names
assert ev[-1]['loss'] < ev[0]['loss'], (ev[0]['loss'], ev[-1]['loss'])
assert abs(ev[0]['lr'] - 0.001) < 1e-9 and abs(ev[-1]['lr'] - 0.01) < 1e-9, (ev[0]['lr'], ev[-1]['lr'])  # warmup
clipped = [e for e in ev if e['grad_norm'] > 0.3]
assert clipped and all(abs(e['clip_coef'] - 0.3 / e['grad_norm']) < 1e-4 for e in clipped), clipped[:1]
" || fail "events.jsonl of the finite run: $(head -c 600 finite/events.jsonl)"
  grep -qF "<html" finite/report.html 2>/dev/null || fail "the finite run wrote no report.html"

  # On a terminal the progress line is redrawn in place (\r), not repeated.
  if command -v script >/dev/null; then
    tty_out=$(script -qec "$(printf '%q ' "$NANGUARD" train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y \
    --task regress --steps 30 --batch 16 --out tty)" /dev/null 2>&1)
    grep -q $'\r'"train step 30/30" <<<"$tty_out" || fail "no redrawn progress line on a TTY: $tty_out"
    [ "$(grep -c "train step" <<<"$tty_out")" -le 2 ] || fail "progress lines repeated on a TTY: $tty_out"
  fi
}

# a producer in forward: the batch std is 0, (x - mean) / 0 = NaN in norm
case_a_producer_in_forward() {
  run 3 train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress --steps 5 --batch 8 \
    --out forward
  expect "nanguard train: NON-FINITE"
  expect "first non-finite: step 1 forward aten::div in norm: producer"
  expect "likely cause: division_by_zero (high confidence): "
  expect "in a normalisation (a constant feature or a batch of 1 has std 0, a zero vector norm 0)"
  expect "  remedy: put an eps in the denominator"
  summary forward "
assert f['cause'] == 'division_by_zero' and f['confidence'] == 'high' and 'eps' in f['remedy'], f
assert s['status'] == 'nonfinite' and s['steps'] == 5 and s['final_loss'] is None, s
assert f['step'] == 1 and f['direction'] == 'forward' and f['op'] == 'aten::div', f
assert f['module'] == 'norm' and f['role'] == 'producer' and f['verdict'] == 'reproduced', f
assert 'node' not in f and 'rows' not in f, f
assert s['skipped_steps'] == 5, s"
}

# a backward-only Inf: sqrt(h - min h) is finite forward, 1/(2 sqrt 0) = inf backward
case_a_backward_only_inf() {
  run 3 train --model "$M/sqrt_net.pt" --data "$M/reg.csv" --target y --task regress --steps 4 --batch 16 --out backward
  expect "first non-finite: step 1 backward aten::div (in SqrtBackward0, the backward of aten::sqrt) in root: producer"
  expect "likely cause: sqrt_at_zero (high confidence): backward of aten::sqrt (SqrtBackward0)"
  summary backward "
assert s['status'] == 'nonfinite', s
assert f['cause'] == 'sqrt_at_zero' and 'sqrt(x + 1e-12)' in f['remedy'], f
assert f['direction'] == 'backward' and f['node'] == 'SqrtBackward0' and f['forward_op'] == 'aten::sqrt', f
assert f['module'] == 'root' and f['role'] == 'producer', f
assert 'lin.weight' in f['parameters'], f"

  # --device cuda: on a GPU, the same backward finding (autograd runs it on
  # its device thread); without one, a clear refusal
  out=$(train --model "$M/sqrt_net.pt" --data "$M/reg.csv" --target y --task regress --steps 4 --batch 16 \
        --device cuda --out backward_cuda 2>&1); rc=$?
  if [ "$rc" -eq 2 ]; then
    expect "--device cuda: no CUDA device found (torch sees none); train with --device cpu"
  else
    [ "$rc" -eq 3 ] || fail "--device cuda exited $rc, expected 3 (a GPU) or 2 (none); output:
$out"
    expect "first non-finite: step 1 backward aten::div (in SqrtBackward0, the backward of aten::sqrt) in root: producer"
  fi

  # The same Inf masked by relu's backward: the weights' gradients stay finite,
  # so it did no harm. The guard never notices, and a tracer on every step
  # judges it by its consequence: no finding, and the run is finite.
  run 0 train --model "$M/masked_sqrt_net.pt" --data "$M/reg.csv" --target y --task regress --steps 5 --batch 16 \
    --out masked_guard
  summary masked_guard "assert s['status'] == 'finite' and f is None, s"
  run 0 train --model "$M/masked_sqrt_net.pt" --data "$M/reg.csv" --target y --task regress --steps 5 --batch 16 \
    --trace always --out masked_always
  expect "nanguard train: finite"
  summary masked_always "assert s['status'] == 'finite' and s['skipped_steps'] == 0 and f is None, s"
}

# a NaN and an Inf in the data: lines 12 and 42 of reg_nan.csv
case_nan_and_inf_in_the_data() {
  run 0 train --model "$M/linear_reg.pt" --data "$M/reg_nan.csv" --target y --task regress --steps 40 --batch 16 \
    --lr 0.05 --out data_off
  expect "nanguard train: recovered"
  expect "in lin: input (features)"
  expect "the NaN/Inf came from the data: $M/reg_nan.csv line"
  summary data_off "
assert s['status'] == 'recovered' and isinstance(s['final_loss'], float), s
assert f['role'] == 'input' and f['direction'] == 'forward' and f['module'] == 'lin', f
assert f['culprit'] == 'features', f
assert f['rows'] and set(f['rows']) <= {12, 42}, f
assert s['skipped_steps'] >= 2, s"
  # A NaN in the target (line 22) reaches the loss: the summary names its line.
  # The run ends finite (exit 0) but at a loss above its first taken step's
  # (0.93 at step 19 against 0.39 at step 2): unrecovered, as `nanguard
  # report` says of the same events (run_status), not recovered.
  { head -21 "$M/reg.csv"; echo "0.1,0.2,0.3,0.4,"; tail -n +22 "$M/reg.csv" | head -20; } > target_nan.csv
  run 0 train --model "$M/linear_reg.pt" --data target_nan.csv --target y --task regress --steps 20 --batch 8 \
    --out target_nan
  expect "the NaN/Inf came from the data: target_nan.csv line 22"
  expect "nanguard train: unrecovered"
  expect "not recovered: the loss ended at 0.932"
  expect "not below its first, 0.388"
  summary target_nan "
assert s['status'] == 'unrecovered' and abs(s['final_loss'] - 0.932) < 1e-3, s
assert f['rows'] == [22] and f['op'] == 'aten::mse_loss' and f['role'] == 'input', f"
  run 0 "$NANGUARD" report target_nan/events.jsonl -o target_nan/again.html
  grep -qF '"status":"unrecovered"' target_nan/again.html || fail "nanguard report's status of target_nan is not unrecovered"
  # --trace always names the same input
  run 0 train --model "$M/linear_reg.pt" --data "$M/reg_nan.csv" --target y --task regress --steps 8 --batch 16 \
    --trace always --out data_always
  summary data_always "assert f['role'] == 'input' and set(f['rows']) <= {12, 42} and f['rows'], f"
  # --trace off: the step is still caught (the sentinel), but no op is named
  run 0 train --model "$M/linear_reg.pt" --data "$M/reg_nan.csv" --target y --task regress --steps 8 --batch 16 \
    --trace off --out data_trace_off
  expect "(no op named: --trace off)"
  # (its loss rose, 1.33 at step 2 to 2.14 at step 8: unrecovered)
  summary data_trace_off "assert s['status'] == 'unrecovered' and f['op'] is None and f['step'] >= 1, s"
  run 0 train --model "$M/linear_reg.pt" --data "$M/reg_nan.csv" --target y --task regress --steps 40 --batch 16 \
    --lr 0.05 --firewall drop --out data_drop
  expect "nanguard train: finite"
  expect "data firewall (drop): 2 rows dropped, 0 rows repaired"
  summary data_drop "
assert s['status'] == 'finite' and f is None, s
assert s['data']['rows_dropped'] == 2 and s['data']['rows_repaired'] == 0, s['data']"
  run 0 train --model "$M/linear_reg.pt" --data "$M/reg_nan.csv" --target y --task regress --steps 40 --batch 16 \
    --firewall repair --out data_repair
  summary data_repair "assert s['status'] == 'finite' and s['data']['rows_repaired'] == 2 and s['data']['rows_dropped'] == 0, s"
}

# an LR that blows up: SGD on large features diverges to Inf
case_an_lr_that_blows_up() {
  run 3 train --model "$M/linear_reg.pt" --data "$M/big.csv" --target y --task regress --steps 150 --batch 16 \
    --optimizer sgd --lr 0.05 --policy skip --out blowup_skip
  summary blowup_skip "assert s['status'] == 'nonfinite' and f is not None and s['skipped_steps'] > 0, s"
  # The default, auto: the divergence is rolled back with the LR cut, and the run recovers.
  run 0 train --model "$M/linear_reg.pt" --data "$M/big.csv" --target y --task regress --steps 150 --batch 16 \
    --optimizer sgd --lr 0.05 --out blowup_auto
  expect "nanguard train: recovered"
  summary blowup_auto "assert s['status'] == 'recovered' and s['policy'] == 'auto' and s['rollbacks'] >= 1, s"
  run 0 train --model "$M/linear_reg.pt" --data "$M/big.csv" --target y --task regress --steps 150 --batch 16 \
    --optimizer sgd --lr 0.05 --policy rollback --out rollback
  expect "nanguard train: recovered"
  expect "rollbacks (LR x"
  summary rollback "
assert s['status'] == 'recovered' and s['rollbacks'] >= 1 and s['lr_factor'] < 1, s
assert isinstance(s['final_loss'], float), s['final_loss']
assert f is not None and f['step'] >= 2, f"
  # An LR 60x that one, diverging from the first step (#57): every rollback
  # goes back to the initial weights (no step since was calm), the cut
  # escalates (x0.5, x0.25, x0.125, ...) and the run recovers in as many steps.
  run 0 train --model "$M/linear_reg.pt" --data "$M/big.csv" --target y --task regress --steps 150 --batch 16 \
    --optimizer sgd --lr 3.0 --policy rollback --out from_step_1
  expect "nanguard train: recovered"
  expect "loss diverging from the start: "
  expect "(finite: the guard acted before a NaN/Inf)"
  expect "remedy: lower the LR or warm it up longer"
  expect "rolled back to the initial weights (the snapshot before step 1)"
  summary from_step_1 "
assert s['status'] == 'recovered' and 1 <= s['rollbacks'] <= 6 and s['lr_factor'] < 0.05, s
assert s['final_loss'] < 1.0, s['final_loss']"
}

# abort: exit 3 and a bundle; inspect and replay it
case_abort_inspect_replay() {
  run 3 train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress --steps 5 --batch 8 \
    --policy abort --out abort
  expect "repro bundle: abort/bundles/step-000001"
  summary abort "
assert s['status'] == 'nonfinite' and s['steps'] == 1 and s['bundle'] == 'abort/bundles/step-000001', s
assert f['op'] == 'aten::div' and f['module'] == 'norm', f"
  [ "$(wc -l < abort/events.jsonl)" -eq 1 ] || fail "abort: events.jsonl should hold one step"
  grep -qF '"action":"abort"' abort/events.jsonl || fail "abort: the event's action should be abort: $(cat abort/events.jsonl)"
  B=abort/bundles/step-000001
  run 0 "$NANGUARD" inspect "$B"
  expect "repro bundle $B"
  expect "step 1, loss nan"
  expect "policy abort, verdict reproduced"
  expect "task: regress"
  expect "aten::div"
  expect "batch[0]"
  expect "parameters: lin.weight"
  expect "culprit_inputs[0]"
  expect "cause:     division_by_zero (high confidence)"
  expect "verified:  verified finite: eps 1e-05 on the zero denominators of aten::div (replayed loss"
  # A compiled model's bundle (verdict "compiled only": the eager replay ran finite,
  # no finding): inspect says why there is no finding, and the note (stage, kernel, remedy).
  cp -r "$B" compiled_only
  python3 - compiled_only/meta.json <<'EOF'
import json, sys
meta = json.load(open(sys.argv[1]))
meta.update(verdict="compiled only", finding=None,
            note="compiled only: Inductor's kernel cpp_fused_log_0 made the NaN/Inf; remedy: run it eagerly")
json.dump(meta, open(sys.argv[1], "w"))
EOF
  run 0 "$NANGUARD" inspect compiled_only
  expect "verdict compiled only"
  expect "finding: none (only the compiled code made the NaN/Inf: the eager replay under the tracer ran finite"
  expect "note: compiled only: Inductor's kernel cpp_fused_log_0 made the NaN/Inf; remedy: run it eagerly"
  grep -qF "not replayed" <<<"$out" && fail "inspect says a replayed step was not replayed: $out"
  run 3 "$NANGUARD" replay "$B" --model "$M/norm_net.pt"
  expect "reproduced: loss nan"
  expect "aten::div"
  expect "remedy:    put an eps in the denominator"
  expect "matches the bundle's finding"
  # The same step with the fixed model (std + eps): finite
  run 0 "$NANGUARD" replay "$B" --model "$M/norm_net_eps.pt"
  expect "not reproduced: the step ran finite"
  # A bundle of data with a NaN names the CSV line on replay too
  run 3 train --model "$M/linear_reg.pt" --data "$M/reg_nan.csv" --target y --task regress --steps 40 --batch 16 \
    --policy abort --out abort_data
  run 3 "$NANGUARD" replay "$(ls -d abort_data/bundles/step-*)" --model "$M/linear_reg.pt"
  expect "the NaN/Inf came from the data: $M/reg_nan.csv, line"
  # The bundle replayed with a missing model, and with a model it was not written from: exit 2.
  run 2 "$NANGUARD" replay "$B" --model missing.pt
  expect "cannot open model 'missing.pt'"
  run 2 "$NANGUARD" replay "$B" --model "$M/mlp_clf.pt"
  expect "cannot replay '$B' with '$M/mlp_clf.pt': nanguard::guard::replay: the bundle's parameter"
  expect "is not in the model"
}

# the remedy verified on a replay of the bad step; --auto-fix keeps it for the later steps
case_verified_remedy_and_auto_fix() {
  run 3 train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress --steps 5 --batch 8 \
    --out verified
  expect "  verified: verified finite: eps 1e-05 on the zero denominators of aten::div (replayed loss"
  summary verified "
assert s['auto_fix'] is None, s
c = f['remedy_checks'][0]
assert (c['remedy'], c['result']) == ('denominator_eps', 'finite') and 'aten::div' in c['applied'], f"
  run 0 train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress --steps 5 --batch 8 \
    --auto-fix --out auto_fix
  expect "nanguard train: recovered"
  expect "steps: 5 of 5, 1 skipped"
  expect "auto_fix: kept eps 1e-05 on the zero denominators of aten::div from step 1: make it a change to the model"
  summary auto_fix "
assert s['auto_fix'] == 'eps 1e-05 on the zero denominators of aten::div' and s['skipped_steps'] == 1, s"
  run 3 train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress --steps 5 --batch 8 \
    --policy skip --no-verify-remedies --out unverified --quiet
  grep -qF "verified:" <<<"$out" && fail "--no-verify-remedies still verified a remedy: $out"
  run 2 train --model "$M/norm_net.pt" --data "$M/constant.csv" --target y --task regress \
    --auto-fix --no-verify-remedies --out both
  expect "excludes"
}

# bad input: exit 2 and one line saying what
# a planted fault (--inject): a transient NaN is redone and told; a
# persistent one reproduces and is named at its op; a bad spec is exit 2
case_a_planted_fault() {
  run 0 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --steps 8 --batch 16 \
    --lr 0.01 --out transient --inject "op=aten::addmm,step=4,kind=nan"
  expect "step 4: transient fault: injected: nan written into"
  expect "transient faults: 1 (a run of the step from the same state computed something else"
  python3 -c "
import json
ev = [json.loads(l) for l in open('transient/events.jsonl')]
e = ev[3]
assert (e['step'], e['action'], e['fault'], e['verdict']) == (4, 'step', 'transient', 'not reproduced'), e
assert all(len(x['signature']) == 16 for x in ev), [x.get('signature') for x in ev]
" || fail "events.jsonl of the transient fault: $(sed -n 4p transient/events.jsonl)"
  # every step from 4 on makes the Inf again: named at its op, and the run ends non-finite
  run 3 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --steps 8 --batch 16 \
    --lr 0.01 --out persistent --inject "op=aten::addmm,step=4,kind=inf,mode=persistent,element=2"
  expect "step 4: inf from aten::addmm in lin (forward)"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --inject "op=aten::addmn"
  expect "'aten::addmn' is not an operator PyTorch knows"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --inject "op=aten::addmm,stpe=2"
  expect "no field 'stpe'"
}

case_bad_input() {
  run 2 train --model missing.pt --data "$M/reg.csv" --target y --task regress
  expect "cannot open model 'missing.pt': no such file"
  echo "not a model" > junk.pt
  run 2 train --model junk.pt --data "$M/reg.csv" --target y --task regress
  expect "'junk.pt' is not a TorchScript model"
  run 2 train --model "$M/linear_reg.pt" --data missing.csv --target y --task regress
  expect "missing.csv"
  run 2 train --model "$M/linear_reg.pt" --data "$M/wide.csv" --target y --task regress
  expect "the model expects 4 input features (its first weight 'lin.weight' is [1, 4]) but '$M/wide.csv' has 5 feature columns"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target label --task regress
  expect "no column 'label' in '$M/reg.csv'; its columns are: a, b, c, d, y"
  run 2 train --model "$M/mlp_clf.pt" --data "$M/reg.csv" --target y --task classify
  expect "--task classify needs integer class labels"
  run 2 train --model "$M/linear_reg.pt" --data "$M/clf.csv" --target y --task classify
  expect "--task classify needs [rows, classes] logits"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task sort
  expect "--task"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --steps 0
  expect "--steps: must be an integer in [1, 1000000000], got 0"
  # a feature column with no finite value: neither firewall policy can train (exit 2, not 1) (#41)
  printf 'a,b,c,d,y\n1,,1,1,1\n2,nan,2,2,2\n3,,3,3,3\n' > empty_b.csv
  for policy in repair drop; do
    run 2 train --model "$M/linear_reg.pt" --data empty_b.csv --target y --task regress --firewall $policy
    expect "no value of column 'b' of 'empty_b.csv' is finite: --firewall $policy cannot train on it"
  done
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --lr -1
  expect "--lr must be a finite number > 0, got -1"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --batch 0
  expect "--batch must be at least 1, got 0"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --clip -1
  expect "--clip must be a finite number >= 0 (0: no clipping), got -1"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --steps many
  expect "--steps"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --warmup 10 --steps 5
  expect "--warmup must be in [0, --steps)"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --policy explode
  expect "--policy"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --firewall on
  expect "--firewall"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --trace sometimes
  expect "--trace"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --target y --task regress --optimizer lbfgs
  expect "--optimizer"
  run 2 train --model "$M/linear_reg.pt" --data "$M/reg.csv" --task regress
  expect "--target is required"
  run 2 "$NANGUARD" inspect no-such-bundle
  expect "no bundle at 'no-such-bundle'"
  mkdir -p not_a_bundle
  run 2 "$NANGUARD" inspect not_a_bundle
  expect "'not_a_bundle' is not a repro bundle"
  expect "meta.json"
  run 2 "$NANGUARD" replay not_a_bundle --model "$M/norm_net.pt"
  expect "is not a repro bundle"
}

run_cases a_finite_run \
  a_producer_in_forward \
  a_planted_fault \
  a_backward_only_inf \
  nan_and_inf_in_the_data \
  an_lr_that_blows_up \
  abort_inspect_replay \
  verified_remedy_and_auto_fix \
  bad_input

if [ "$failures" -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "train_cli: all checks passed"
