#!/usr/bin/env bash
# The GPU run of issue #23, in one command on the project's GPU machine (one
# H200, torch in the image's Python, no network), from the repository root:
#   scripts/stage-device-deps        # here, first: what the build needs beyond torch
#   run(command="bench/gpu/run.sh", carry=["build-device"], timeout_s=420)
# 1. builds nanguard's library, CUDA kernels, C++ CUDA tests and Python module
#    (scripts/device-build, into build-device/build: about a minute on 16 cores);
# 2. runs the CUDA tests: tests/cuda_test.cpp (census, record and tracer on
#    CUDA against the CPU, the tracer with no host sync per op, autocast, the
#    loss scaler against GradScaler, the advisor, Gloo on CUDA gradients),
#    the Python suites parametrised over devices (every tracer case on CUDA,
#    the census, the guard), a NaN only a compiled model's Triton kernel
#    makes (test_compile.py's CUDA case), the record's CPU tests, the
#    tracer's deferred path against its eager one (tracer_deferred.*), and
#    `nanguard demo --device cuda` on two scenarios (tests/cli/demo_cli_test.sh's on_cuda);
# 3. runs bench/gpu/overhead.py: step-time ratios of the checking tools on
#    the reference and large workloads, interleaved rounds, medians, and the
#    census throughput at 2^26 against x.sum();
# 4. runs python/bench/bench_compile.py on the large workload compiled
#    (Triton kernels): the guard against the compiled plain step, and the
#    recompiles it causes (about a minute, most of it compiling; last, so
#    that a run cut short by its timeout loses only this figure).
# About 5 to 6 minutes in all (estimated: it has not run yet). Logs under $OUT
# (else build-device/out).
#
#   bench/gpu/run.sh --dry-run   here, on the CPU: the same steps against the
#     existing build/ (make build), the tests (their CUDA cases skip, saying
#     so) and the benchmark shrunk (--device cpu --tiny, 2 rounds).
# Stops with a clear message, at once, where no GPU is found.
set -uo pipefail
cd "$(dirname "$0")/../.."

dry_run=0
[[ ${1:-} == --dry-run ]] && dry_run=1
out=${OUT:-build-device/out}
mkdir -p "$out"
say() { echo "run.sh: $*"; }
step_start=$SECONDS
elapsed() { echo "$((SECONDS - step_start)) s"; }
targets=(nanguard cuda_test census_test tracer_test nanguard_cli _nanguard)
target_args=()
for t in "${targets[@]}"; do target_args+=(--target "$t"); done

if ((dry_run)); then
  build=${NANGUARD_BUILD:-build}
  python=$(cat "$build/.python" 2>/dev/null) || { say "no $build/.python: run make build first"; exit 1; }
  [[ -d build-device/deps ]] || say "note: build-device/deps is not staged; run scripts/stage-device-deps before the GPU run"
  say "dry run on the CPU against $build"
  nice -n 19 cmake --build "$build" -j2 "${target_args[@]}" > "$out/build.log" 2>&1 \
    || { grep -aE "error|FAILED" "$out/build.log" | head -20; exit 1; }
  bench_args=(--device cpu --tiny --rounds 2 --steps 1)
  compile_args=(--device cpu --workload reference)
  compile_rounds=1
  runner=(nice -n 19)
else
  build=build-device/build
  python=$(command -v python3)
  if ! "$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2> /dev/null; then
    say "no CUDA GPU found here (in python3, torch.cuda.is_available() is not true): run it on the GPU machine" \
        "(run(command=\"bench/gpu/run.sh\", carry=[\"build-device\"])), or bench/gpu/run.sh --dry-run for the CPU"
    exit 2
  fi
  say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null), torch $("$python" -c 'import torch; print(torch.__version__)')"
  scripts/device-build "$out" "${targets[@]}" || exit 1
  bench_args=()
  compile_args=(--device cuda --workload large)
  compile_rounds=10
  runner=()
fi
say "built in $(elapsed)"

rc=0
step_start=$SECONDS
"${runner[@]}" "$build/tests/cuda_test" > "$out/cuda_test.log" 2>&1 || rc=1
"${runner[@]}" "$build/tests/census_test" --gtest_filter='nonfinite_record.*' \
  > "$out/record_test.log" 2>&1 || rc=1
"${runner[@]}" "$build/tests/tracer_test" --gtest_filter='tracer_deferred.*' > "$out/deferred_test.log" 2>&1 || rc=1
grep -ahE "^\[  (PASSED|FAILED|SKIPPED) \] [0-9]+ test|^\[  FAILED  \] [a-z]|Failure$" "$out/cuda_test.log" \
  "$out/record_test.log" "$out/deferred_test.log" | head -40
grep -ah "^no CUDA device found" "$out/cuda_test.log" | sort -u | sed 's/^/run.sh: skipped: /'
PYTHONPATH=$build/python "${runner[@]}" "$python" -m pytest -q -p no:cacheprovider -rs \
  python/tests/test_trace.py python/tests/test_census.py python/tests/test_guard.py \
  "python/tests/test_compile.py::test_a_nan_only_the_compiled_code_makes_on_cuda_is_named_with_its_triton_kernel" \
  > "$out/pytest.log" 2>&1 || rc=1
grep -aE "passed|failed|error" "$out/pytest.log" | tail -5
grep -acE "^SKIPPED.*no CUDA device" "$out/pytest.log" | sed 's/^/run.sh: pytest cases skipped for want of a GPU: /'
CLI_CASE=on_cuda "${runner[@]}" bash tests/cli/demo_cli_test.sh "$build/tools/cli/nanguard" "$out/demo" \
  > "$out/demo_cuda.log" 2>&1 || rc=1
tail -3 "$out/demo_cuda.log" | sed 's/^/run.sh: demo --device cuda: /'
say "tests in $(elapsed) (exit $rc; logs in $out)"

step_start=$SECONDS
PYTHONPATH=$build/python "${runner[@]}" "$python" bench/gpu/overhead.py "${bench_args[@]}" 2>&1 \
  | tee "$out/overhead.log" || rc=1
say "benchmark in $(elapsed)"

step_start=$SECONDS
NANGUARD_BENCH_ROUNDS=$compile_rounds PYTHONPATH=$build/python "${runner[@]}" "$python" python/bench/bench_compile.py \
  "${compile_args[@]}" 2>&1 | tee "$out/compile.log" || rc=1
say "compiled benchmark in $(elapsed)"
exit $rc
