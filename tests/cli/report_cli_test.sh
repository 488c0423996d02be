#!/usr/bin/env bash
# `nanguard report` end to end: event logs written here (a run with a NaN step,
# a rollback and a finding whose module name holds "</script>", a 100k-step
# run, an empty log), the HTML page opened in a real headless Chromium, and
# the DOM checked: every plot drawn, no script or console error. A screenshot
# lands in OUT/report.png. Then the bad inputs and their exit codes.
#   usage: report_cli_test.sh NANGUARD OUT  (CLI_CASE=NAME runs one case)
set -euo pipefail
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"  # run_cases; this script fails at the first check
NANGUARD=$1
OUT=$2
rm -rf "$OUT"
mkdir -p "$OUT"
cd "$OUT"

fail() { echo "FAIL${current_case:+ [$current_case]}: $*" >&2; exit 1; }
# expect CODE CMD...: runs CMD, checks its exit code, keeps stdout/stderr.
expect() {
  local want=$1; shift
  set +e
  "$@" >out.txt 2>err.txt
  local got=$?
  set -e
  [[ $got -eq $want ]] || { cat out.txt err.txt >&2; fail "'$*' exited $got, expected $want"; }
}

CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
[[ -n "$CHROMIUM" && -x "$CHROMIUM" ]] ||
  fail "chromium is not installed: this test opens the report in a real headless browser; run scripts/setup-deps (it installs Debian's chromium) or set CHROMIUM=/path/to/chromium"

# ---------------------------------------------------------------- event logs
mkdir -p baseline
/usr/bin/python3 - <<'EOF'
import json, math
def ev(step, **kw):
    e = {"step": step, "loss": 2.0 / math.sqrt(step), "grad_norm": 1.0 + 0.3 * math.sin(step / 5),
         "clip_coef": 1.0, "scale": 65536.0, "lr": 1e-3 * min(1.0, step / 50), "skipped": False,
         "action": "step", "spikes": [], "nonfinite_params": [], "findings": [],
         "top_norms": [{"name": "encoder.layers.0.weight", "norm": 0.9}, {"name": "head.weight", "norm": 0.2 + step / 1000},
                       {"name": "encoder.norm.weight", "norm": 0.05}]}
    e.update(kw)
    return e
stats = lambda nan: {"numel": 32, "nan": nan, "pos_inf": 0, "neg_inf": 0, "finite": 32 - nan, "zeros": 4, "subnormal": 0,
                     "min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.25, "l2_norm": 3.0, "absmax": 1.0,
                     "fp16_overflow": 0, "fp16_underflow": 0, "bf16_overflow": 0,
                     "first_nonfinite_index": 12 if nan else -1, "first_nonfinite_value": "nan" if nan else 0.0}
finding = {"step": 120, "op": "aten::div", "caller": "", "direction": "forward", "node": "", "forward_op": "",
           "role": "producer", "module": "enc</script><script>document.title='pwned'</script>", "culprit": "",
           "inputs": [{"name": "input 0", "dtype": "Float", "shape": [8, 4], "stats": stats(0)}],
           "outputs": [{"name": "output 0", "dtype": "Float", "shape": [8, 4], "stats": stats(4)}],
           "output": 0, "index": 12, "value": "nan", "thread": 1, "sequence_nr": 7, "backtrace": "", "rank": -1,
           "remedy_checks": [{"remedy": "float32", "applied": "aten::div in float32", "result": "still_nonfinite",
                              "loss": "nan", "detail": "step 120 forward aten::div: nan"},
                             {"remedy": "denominator_eps", "applied": "eps 1e-05 on the zero denominators of aten::div",
                              "result": "finite", "loss": 0.52, "detail": ""}]}
backward = dict(finding, step=200, op="aten::mul", direction="backward", node="SqrtBackward0", forward_op="aten::sqrt",
                module="encoder.layers.0", value="inf",
                remedy_checks=[{"remedy": "none", "applied": "", "result": "not_checkable", "loss": "nan",
                                "detail": "no rewrite of aten::mul for sqrt_at_zero"}])
with open("baseline/events.jsonl", "w") as f:
    scale = 65536.0
    for s in range(1, 301):
        e = ev(s, scale=scale)
        if s == 120:
            e.update(loss="nan", grad_norm="nan", skipped=True, action="backoff", verdict="reproduced",
                     findings=[finding], nonfinite_params=[{"name": "encoder.layers.0.weight", "nonfinite": 7}],
                     remedy="skipped the step; loss scale 65536 -> 32768")
            scale /= 2
        if s == 180:
            e["spikes"] = [{"series": "grad_norm", "value": 40.0, "z": 9.1}]
            e["grad_norm"] = 40.0
        if s == 200:
            e.update(grad_norm="inf", skipped=True, action="rollback", rollback_to=150, findings=[backward],
                     note="moved most since the snapshot: encoder.layers.0.weight (x3.2)")
        f.write(json.dumps(e) + "\n")
with open("long.jsonl", "w") as f:
    for s in range(1, 100001):
        e = {"step": s, "loss": 3.0 / (1 + s / 1000) + 0.05 * math.sin(s), "grad_norm": 1 + 0.2 * math.cos(s / 3),
             "scale": 1.0, "lr": 1e-3, "skipped": False, "action": "step",
             "top_norms": [{"name": "w1", "norm": 0.7}, {"name": "w2", "norm": 0.1}]}
        if s % 25000 == 0:
            e.update(loss="inf", skipped=True, action="skip")
        f.write(json.dumps(e, separators=(",", ":")) + "\n")
EOF
: >empty.jsonl

# The report: written, self-contained, and opened in a real headless Chromium.
case_the_report_in_a_browser() {
  start=$(date +%s%N)
  expect 0 "$NANGUARD" report baseline/events.jsonl long.jsonl empty.jsonl -o report.html --title "report test"
  ms=$((($(date +%s%N) - start) / 1000000))
  grep -q "wrote report.html (3 runs, 100300 steps" out.txt || { cat out.txt; fail "unexpected summary line"; }
  echo "report of 100300 steps written in ${ms} ms, $(($(stat -c %s report.html) / 1024)) KiB"
  [[ $(stat -c %s report.html) -lt 3000000 ]] || fail "report.html is $(stat -c %s report.html) bytes: downsampling failed?"
  # Self-contained: nothing is loaded from elsewhere.
  if grep -Eq '<(link|img|iframe)\b|<script[^>]+src=' report.html; then fail "report.html loads an external resource"; fi
  # Runs are named after their directory (events.jsonl) or file.
  for name in '"name":"baseline"' '"name":"long"' '"name":"empty"'; do
    grep -q "$name" report.html || fail "no run $name in the page"
  done
  # The finding's module cannot close the data's <script> element.
  [[ $(grep -o '</script>' report.html | wc -l) -eq 3 ]] || fail "a string in the data closed a <script> element"

  # ---------------------------------------------------------------- in Chromium
  # One browser profile per run (several tests may run at once).
  browse() {
    local profile
    profile=$(mktemp -d "$OUT/profile.XXXXXX")
    timeout 180 "$CHROMIUM" --headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run \
      --user-data-dir="$profile" --virtual-time-budget=5000 "$@"
  }
  browse --enable-logging=stderr --v=0 --dump-dom "file://$OUT/report.html" >dom.html 2>chromium.log ||
    { tail -20 chromium.log >&2; fail "chromium could not load report.html"; }
  grep -q 'data-rendered="8"' dom.html ||
    fail "expected 8 plots drawn (4 per run with steps), got: $(grep -o 'data-rendered="[0-9]*"' dom.html)"
  grep -q 'data-runs="3"' dom.html || fail "the page did not render its 3 runs"
  if grep -q 'data-errors=' dom.html; then
    fail "the page reported script errors: $(grep -o '<div class="error-line">[^<]*' dom.html | head -5)"
  fi
  grep -q '<div id="errors" class="errors" hidden=""></div>' dom.html || fail "the #errors box is not empty"
  # The page logs nothing to the console: any console line (Chromium logs
  # console.error at INFO level) or uncaught exception is a failure.
  if grep -E ':CONSOLE[:(]|Uncaught' chromium.log; then fail "console messages or errors while loading the page"; fi
  [[ $(grep -o '<svg class="chart"' dom.html | wc -l) -eq 8 ]] || fail "expected 8 <svg> charts"
  [[ $(grep -o '<path class="line"' dom.html | wc -l) -ge 12 ]] || fail "too few plotted lines"
  grep -q '<path class="nonfinite"' dom.html || fail "NaN/Inf points are not marked"
  grep -q '<path class="skipband"' dom.html || fail "skipped steps are not marked"
  grep -q '<line class="rollback"' dom.html || fail "the rollback is not marked"
  grep -q 'data-op="aten::div"' dom.html || fail "the forward finding is missing"
  grep -q 'SqrtBackward0' dom.html || fail "the backward finding's node is missing"
  # Findings logged without a diagnosis are diagnosed on reading; each card shows cause and remedy.
  [[ $(grep -o '<div class="diagnosis">' dom.html | wc -l) -eq 2 ]] || fail "expected 2 findings with a diagnosis"
  grep -q 'division_by_zero (low confidence)' dom.html || fail "the forward finding's cause is missing"
  grep -q 'sqrt_at_zero (high confidence)' dom.html || fail "the backward finding's cause is missing"
  grep -q 'torch::sqrt(x + 1e-12)' dom.html || fail "the backward finding's remedy is missing"
  grep -q 'skipped the step; loss scale 65536 -&gt; 32768' dom.html || fail "the remedy the guard applied is missing"
  # The remedies tried on replays of the step: a line each, the verified one highlighted.
  [[ $(grep -o '<div class="remedy-checks">' dom.html | wc -l) -eq 2 ]] || fail "expected 2 findings with remedy checks"
  [[ $(grep -o '<p class="check finite verified">' dom.html | wc -l) -eq 1 ]] || fail "expected 1 verified remedy"
  grep -q 'finite</span><span>: eps 1e-05 on the zero denominators of aten::div (replayed loss 0.52)' dom.html ||
    fail "the verified remedy's line is missing"
  grep -q 'still non-finite</span><span>: aten::div in float32; step 120 forward aten::div: nan' dom.html ||
    fail "the still non-finite check's line is missing"
  grep -q 'not checkable</span><span>: none; no rewrite of aten::mul for sqrt_at_zero' dom.html ||
    fail "the not checkable check's line is missing"
  grep -q 'encoder.layers.0.weight' dom.html || fail "the per-parameter grad norms are missing"
  grep -q 'Plots show [0-9]* of 100000 steps' dom.html || fail "the long run does not say it was downsampled"
  grep -q 'No training steps logged.' dom.html || fail "the empty run is not listed"
  grep -q '<title>report test</title>' dom.html || fail "the page title changed: the finding's module ran as script"
  grep -q "enc&lt;/script&gt;&lt;script&gt;document.title" dom.html || fail "the finding's module is not shown as text"

  browse --screenshot="$OUT/report.png" --window-size=1400,2000 "file://$OUT/report.html" >/dev/null 2>screenshot.log ||
    { tail -20 screenshot.log >&2; fail "chromium could not take a screenshot"; }
  [[ -f report.png && $(stat -c %s report.png) -gt 30000 ]] || fail "report.png is missing or blank"

  # The DOM checks can fail: a page whose data is broken reports its error.
  sed 's/"series":{/"series_broken":{/' report.html >broken.html
  browse --dump-dom "file://$OUT/broken.html" >broken_dom.html 2>/dev/null || fail "chromium could not load broken.html"
  grep -q 'data-errors="1"' broken_dom.html || fail "a render error in the page was not captured in #errors"
  grep -q 'render failed' broken_dom.html || fail "the captured error does not say the render failed"
}

# Bad input: exit 2 and one line saying what.
case_bad_input() {
  expect 2 "$NANGUARD" report missing.jsonl -o x.html
  grep -q "cannot open event log 'missing.jsonl'" err.txt || fail "missing log: $(cat err.txt)"
  [[ $(wc -l <err.txt) -eq 1 ]] || fail "the error should be one line: $(cat err.txt)"
  head -3 baseline/events.jsonl >bad.jsonl
  echo '{"step": 4, "loss": 1.0' >>bad.jsonl
  expect 2 "$NANGUARD" report baseline/events.jsonl bad.jsonl -o x.html
  grep -q "bad.jsonl:4: not a step event" err.txt || fail "malformed log: $(cat err.txt)"
  [[ $(wc -l <err.txt) -eq 1 ]] || fail "the error should be one line: $(cat err.txt)"
  echo '{"step": 1, "loss": "lots", "action": "step"}' >badnum.jsonl
  expect 2 "$NANGUARD" report badnum.jsonl -o x.html
  grep -q "badnum.jsonl:1:.*'loss' should be a number.*(\"lots\")" err.txt || fail "bad number: $(cat err.txt)"
  expect 2 "$NANGUARD" report baseline -o x.html
  grep -q "'baseline' is a directory" err.txt || fail "directory as log: $(cat err.txt)"
  expect 2 "$NANGUARD" report baseline/events.jsonl
  grep -q -- "nothing to write: pass -o report.html for the HTML page, --tensorboard DIR" err.txt || fail "missing -o: $(cat err.txt)"
  expect 2 "$NANGUARD" report baseline/events.jsonl -o no/such/dir/x.html
  grep -q "no/such/dir/x.html" err.txt || fail "unwritable output: $(cat err.txt)"
  [[ ! -e x.html ]] || fail "a failed report left x.html behind"
  # The page must not replace a log it reads (also through another path).
  cp baseline/events.jsonl keep.jsonl
  expect 2 "$NANGUARD" report baseline/events.jsonl keep.jsonl -o ./keep.jsonl
  grep -q "the output ./keep.jsonl is the event log keep.jsonl" err.txt || fail "output onto a log: $(cat err.txt)"
  cmp -s keep.jsonl baseline/events.jsonl || fail "report -o onto its own log changed the log"
  # A log without events (0 bytes, blank lines): said, with where to look; exit 2 and nothing written.
  expect 2 "$NANGUARD" report empty.jsonl -o nothing.html
  grep -q "the event log 'empty.jsonl' holds no events (it is empty): the run wrote none" err.txt ||
    fail "empty log: $(cat err.txt)"
  grep -q "check the path" err.txt || fail "empty log: no fix said: $(cat err.txt)"
  [[ ! -e nothing.html ]] || fail "a report of an empty log was written"
  printf '\n  \n' >blank.jsonl
  expect 2 "$NANGUARD" report blank.jsonl --tensorboard tb_blank
  grep -q "the event log 'blank.jsonl' holds no events (only blank lines)" err.txt || fail "blank log: $(cat err.txt)"
  # Beside a log with events, the empty one is a warning (an "empty" run on the page).
  expect 0 "$NANGUARD" report baseline/events.jsonl empty.jsonl -o mixed.html
  grep -q "nanguard: warning: the event log 'empty.jsonl' holds no events" err.txt || fail "no warning: $(cat err.txt)"
}

run_cases the_report_in_a_browser bad_input
echo "report_cli: ok"
