#!/usr/bin/env bash
# Distributed training end to end: `nanguard launch` runs examples/distributed_train
# as 2 and 4 ranks over Gloo on loopback.
#   usage: distributed_test.sh NANGUARD DISTRIBUTED_TRAIN WORK_DIR  (CLI_CASE=NAME runs one case)
set -u
source "$(dirname -- "${BASH_SOURCE[0]}")/check.sh"
NANGUARD=$1
TRAIN=$2
WORK=$3
PY=/usr/bin/python3
rm -rf "$WORK" && mkdir -p "$WORK"

# Every rank printed the same params_checksum (and there are $2 of them).
same_checksums() {
  local out=$1 n=$2
  local count distinct
  count=$(grep -c 'params_checksum:' "$out")
  distinct=$(grep 'params_checksum:' "$out" | awk '{print $NF}' | sort -u | wc -l)
  [[ $count == "$n" && $distinct == 1 ]]
}

# check_event LOG_DIR RANKS STEP ACTION BAD_RANK [ROLLBACK_TO]: on every rank
# the event of STEP has ACTION, names BAD_RANK as the only non-finite rank,
# carries a producer finding aten::div tagged with BAD_RANK, and no other
# step was skipped.
check_event() {
  "$PY" - "$@" <<'EOF'
import json, sys
log_dir, ranks, step, action, bad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rollback_to = int(sys.argv[6]) if len(sys.argv) > 6 else None
errors = []
for r in range(ranks):
    events = [json.loads(l) for l in open(f"{log_dir}/rank-{r}.jsonl")]
    for e in events:
        if e.get("rank") != r:
            errors.append(f"rank {r}: event of step {e['step']} has rank {e.get('rank')}")
        if e["step"] == step:
            if e["action"] != action: errors.append(f"rank {r}: step {step} action {e['action']}, want {action}")
            if e.get("nonfinite_ranks") != [bad]:
                errors.append(f"rank {r}: nonfinite_ranks {e.get('nonfinite_ranks')}, want [{bad}]")
            prod = [f for f in e.get("findings", []) if f.get("role") == "producer"]
            if not prod or prod[0].get("op") != "aten::div" or prod[0].get("rank") != bad:
                errors.append(f"rank {r}: step {step} findings {[(f.get('op'), f.get('role'), f.get('rank')) for f in e.get('findings', [])]}, want producer aten::div on rank {bad}")
            if rollback_to is not None and e.get("rollback_to") != rollback_to:
                errors.append(f"rank {r}: rollback_to {e.get('rollback_to')}, want {rollback_to}")
        elif e.get("skipped"):
            errors.append(f"rank {r}: step {e['step']} was skipped too ({e.get('note', '')})")
if errors:
    print("\n".join(errors))
sys.exit(1 if errors else 0)
EOF
}

# Two ranks, skip: rank 1's batch makes a NaN at step 4. The consistency
# check runs every step and (no rank corrupted) names nobody: no other step skips.
case_skip_2_ranks() {
  out=$WORK/skip2.out
  "$NANGUARD" launch -n 2 --timeout 120 -- "$TRAIN" --steps 8 --policy skip --nan-rank 1 --nan-step 4 --check-every 1 \
    --log "$WORK/skip2" --timeout 20 >"$out" 2>&1 || fail "skip, 2 ranks: launch failed: $(tail -5 "$out")"
  grep -q '^\[rank 0\] step 4: skip, non-finite on rank(s) \[1\]' "$out" || fail "skip, 2 ranks: rank 0 does not report rank 1's step 4"
  grep -q '^\[rank 1\] step 4: skip' "$out" || fail "skip, 2 ranks: rank 1 does not report step 4 (lines not prefixed?)"
  grep -q 'rank 1 forward aten::div' "$out" || fail "skip, 2 ranks: the finding does not name aten::div on rank 1"
  check_event "$WORK/skip2" 2 4 skip 1 || fail "skip, 2 ranks: events"
  same_checksums "$out" 2 || fail "skip, 2 ranks: parameter checksums differ: $(grep checksum "$out")"
}

# Four ranks, skip: rank 3's batch at step 5.
case_skip_4_ranks_with_loss_scaling() {
  out=$WORK/skip4.out
  # Dynamic loss scaling: 1024, grows to 2048 after 3 good steps, backs off to
  # 1024 at step 5, grows again at step 8: the same scale on every rank.
  "$NANGUARD" launch -n 4 --timeout 120 -- "$TRAIN" --steps 8 --policy skip --nan-rank 3 --nan-step 5 --check-every 2 \
    --loss-scale 1024 --log "$WORK/skip4" --timeout 20 >"$out" 2>&1 || fail "skip, 4 ranks: launch failed: $(tail -5 "$out")"
  check_event "$WORK/skip4" 4 5 skip 3 || fail "skip, 4 ranks: events"
  [[ $(grep -c 'skipped 1 rollbacks 0 scale 2048$' "$out") == 4 ]] || fail "skip, 4 ranks: loss scales differ: $(grep scale "$out")"
  same_checksums "$out" 4 || fail "skip, 4 ranks: parameter checksums differ: $(grep checksum "$out")"
}

# Four ranks, rollback: every rank restores the snapshot of step 6.
case_rollback_4_ranks() {
  out=$WORK/rollback4.out
  "$NANGUARD" launch -n 4 --timeout 120 -- "$TRAIN" --steps 9 --policy rollback --snapshot-every 3 --nan-rank 2 \
    --nan-step 8 --log "$WORK/rollback4" --timeout 20 >"$out" 2>&1 || fail "rollback, 4 ranks: launch failed: $(tail -5 "$out")"
  check_event "$WORK/rollback4" 4 8 rollback 2 6 || fail "rollback, 4 ranks: events"
  [[ $(grep -c 'rollbacks 1 ' "$out") == 4 ]] || fail "rollback, 4 ranks: not every rank rolled back once"
  same_checksums "$out" 4 || fail "rollback, 4 ranks: parameter checksums differ: $(grep checksum "$out")"
}

# Two ranks, rollback: the same with 2.
case_rollback_2_ranks() {
  out=$WORK/rollback2.out
  "$NANGUARD" launch -n 2 --timeout 120 -- "$TRAIN" --steps 6 --policy rollback --snapshot-every 2 --nan-rank 0 \
    --nan-step 5 --log "$WORK/rollback2" --timeout 20 >"$out" 2>&1 || fail "rollback, 2 ranks: launch failed: $(tail -5 "$out")"
  check_event "$WORK/rollback2" 2 5 rollback 0 4 || fail "rollback, 2 ranks: events"
  same_checksums "$out" 2 || fail "rollback, 2 ranks: parameter checksums differ: $(grep checksum "$out")"
}

# Gradient-consistency check: rank 3's gradient changes after averaging at
# step 4; the check names it, warns, and every rank skips the step.
case_gradient_consistency_check() {
  out=$WORK/corrupt.out
  "$NANGUARD" launch -n 4 --timeout 120 -- "$TRAIN" --steps 5 --check-every 1 --corrupt-rank 3 --corrupt-step 4 \
    --log "$WORK/corrupt" --timeout 20 >"$out" 2>&1 || fail "consistency: launch failed: $(tail -5 "$out")"
  for r in 0 1 2 3; do
    grep -q "^\[rank $r\] step 4: skip.*gradient checksum differs after averaging on rank(s) 3 " "$out" ||
      fail "consistency: rank $r does not name rank 3 at step 4"
  done
  grep -q 'Warning: nanguard::guard: step 4: gradient checksum differs' "$out" || fail "consistency: no warning"
  same_checksums "$out" 4 || fail "consistency: parameter checksums differ: $(grep checksum "$out")"
}

# A rank dies mid-run: the launcher stops the others and names it.
case_a_rank_dies() {
  out=$WORK/kill.out
  start=$SECONDS
  "$NANGUARD" launch -n 2 --timeout 120 -- "$TRAIN" --steps 50 --kill-rank 1 --kill-step 3 --timeout 10 >"$out" 2>&1
  rc=$?
  [[ $rc != 0 ]] || fail "kill: launch exited 0"
  grep -q 'nanguard: error: launch: rank 1 was killed by signal 9 (SIGKILL)' "$out" ||
    fail "kill: the launcher does not name rank 1: $(tail -3 "$out")"
  (( SECONDS - start < 60 )) || fail "kill: took $((SECONDS - start)) s"
}

# Without the launcher, the surviving rank fails with a clear error within
# its c10d timeout instead of hanging.
case_a_survivor_fails_clearly() {
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  start=$SECONDS
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 120 "$TRAIN" --steps 50 --kill-rank 1 \
      --kill-step 3 --timeout 10 >"$WORK/survivor$r.out" 2>&1 &
    pids[$r]=$!
  done
  wait "${pids[0]}"; rc0=$?
  wait "${pids[1]}" 2>/dev/null  # killed by its own SIGKILL
  [[ $rc0 == 1 ]] || fail "survivor: rank 0 exited $rc0, want 1 (124: it hung): $(cat "$WORK/survivor0.out")"
  grep -q 'rank 0: error: nanguard::distributed: rank 0: the .* all-reduce of step 3 failed: rank 1 (host .*, pid [0-9]*) has exited; its own log/stderr says why' "$WORK/survivor0.out" ||
    fail "survivor: unclear error: $(cat "$WORK/survivor0.out")"
  (( SECONDS - start < 60 )) || fail "survivor: took $((SECONDS - start)) s"
}

# The launcher itself: every rank's environment, a failing rank's exit
# status, bad usage, missing environment. The environment is checked on a run
# where every rank succeeds: a failing rank stops the others, maybe before
# they print.
case_the_launcher() {
  "$NANGUARD" launch -n 3 -- sh -c 'echo "hello from $RANK of $WORLD_SIZE at $MASTER_ADDR"' >"$WORK/env.out" 2>&1
  [[ $? == 0 ]] || fail "launch env: not exit 0: $(cat "$WORK/env.out")"
  for r in 0 1 2; do
    grep -q "^\[rank $r\] hello from $r of 3 at 127.0.0.1" "$WORK/env.out" || fail "launch env: $(cat "$WORK/env.out")"
  done
  "$NANGUARD" launch -n 3 -- sh -c 'exit $((RANK == 2 ? 5 : 0))' >"$WORK/status.out" 2>&1
  rc=$?
  [[ $rc == 5 ]] || fail "launch status: exit $rc, want 5"
  grep -q 'rank 2 exited with status 5' "$WORK/status.out" || fail "launch status: $(cat "$WORK/status.out")"
  "$NANGUARD" launch -n 0 -- true >"$WORK/usage.out" 2>&1
  [[ $? == 2 ]] || fail "launch -n 0: not exit 2"
  grep -q 'nanguard: error: launch: -n must be in \[1, 1024\] but is 0' "$WORK/usage.out" || fail "launch -n 0: $(cat "$WORK/usage.out")"
  "$NANGUARD" launch -n 1 --timeout 1 -- sleep 30 >"$WORK/timeout.out" 2>&1
  [[ $? == 124 ]] || fail "launch --timeout: not exit 124 (as timeout(1); 1 is for internal errors)"
  grep -q 'did not finish within --timeout 1 s (still running: rank 0)' "$WORK/timeout.out" ||
    fail "launch --timeout: $(cat "$WORK/timeout.out")"
  # a rank that leaves a background child holding its stdout: launch returns when the rank exits (#41)
  start=$SECONDS
  "$NANGUARD" launch -n 2 -- sh -c 'sleep 30 & echo started $RANK' >"$WORK/child.out" 2>&1
  [[ $? == 0 ]] || fail "launch with a background child: not exit 0: $(cat "$WORK/child.out")"
  (( SECONDS - start < 10 )) || fail "launch waited $((SECONDS - start)) s for a rank's background child"
  grep -q '^\[rank 1\] started 1' "$WORK/child.out" || fail "launch with a background child: $(cat "$WORK/child.out")"
  env -u RANK -u WORLD_SIZE "$TRAIN" >"$WORK/noenv.out" 2>&1
  [[ $? == 1 ]] || fail "no environment: not exit 1"
  grep -q 'environment variable WORLD_SIZE is not set' "$WORK/noenv.out" || fail "no environment: $(cat "$WORK/noenv.out")"
}

# Two nodes on one machine: two launchers (--nnodes 2 --node-rank 0/1, one
# port), 2 ranks each: one job of 4 ranks. Every rank skips rank 3's step 4
# and ends with the same parameters; then node 1's rank 3 dies, and node 0's
# launcher fails with its ranks' clear error within their c10d timeout.
case_two_nodes() {
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for node in 0 1; do
    "$NANGUARD" launch -n 2 --nnodes 2 --node-rank $node --master-addr 127.0.0.1 --port "$port" --timeout 120 -- \
      "$TRAIN" --steps 6 --policy skip --nan-rank 3 --nan-step 4 --timeout 20 >"$WORK/node$node.out" 2>&1 &
    pids[$node]=$!
  done
  wait "${pids[0]}" || fail "two nodes: node 0 failed: $(tail -5 "$WORK/node0.out")"
  wait "${pids[1]}" || fail "two nodes: node 1 failed: $(tail -5 "$WORK/node1.out")"
  grep -q '^\[rank 0\] step 4: skip, non-finite on rank(s) \[3\]' "$WORK/node0.out" ||
    fail "two nodes: rank 0 does not report rank 3's step 4: $(tail -5 "$WORK/node0.out")"
  grep -q '^\[rank 3\] step 4: skip' "$WORK/node1.out" || fail "two nodes: node 1 runs no rank 3: $(tail -5 "$WORK/node1.out")"
  cat "$WORK/node0.out" "$WORK/node1.out" >"$WORK/nodes.out"
  same_checksums "$WORK/nodes.out" 4 || fail "two nodes: the ranks' parameters differ"
  start=$SECONDS
  for node in 0 1; do
    "$NANGUARD" launch -n 2 --nnodes 2 --node-rank $node --port "$port" --timeout 120 -- \
      "$TRAIN" --steps 50 --kill-rank 3 --kill-step 3 --timeout 10 >"$WORK/dead$node.out" 2>&1 &
    pids[$node]=$!
  done
  wait "${pids[0]}" && fail "dead node: node 0's launcher exited 0"
  wait "${pids[1]}" && fail "dead node: node 1's launcher exited 0"
  grep -q 'nanguard: error: launch: rank [01] exited with status 1' "$WORK/dead0.out" ||
    fail "dead node: node 0's launcher does not name its failing rank: $(tail -5 "$WORK/dead0.out")"
  grep -q 'all-reduce of step 3 failed: .*rank [23] (host .*, pid [0-9]*) has exited' "$WORK/dead0.out" ||
    fail "dead node: unclear error on node 0: $(tail -5 "$WORK/dead0.out")"
  (( SECONDS - start < 90 )) || fail "dead node: took $((SECONDS - start)) s"
  "$NANGUARD" launch -n 1 --nnodes 2 -- true >"$WORK/noport.out" 2>&1
  [[ $? == 2 ]] || fail "--nnodes without --port: not exit 2"
  grep -q 'every node needs the same --port' "$WORK/noport.out" || fail "--nnodes without --port: $(cat "$WORK/noport.out")"
}

run_cases skip_2_ranks \
  skip_4_ranks_with_loss_scaling \
  rollback_4_ranks \
  rollback_2_ranks \
  gradient_consistency_check \
  a_rank_dies \
  a_survivor_fails_clearly \
  two_nodes \
  the_launcher
if (( failures > 0 )); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "distributed: all checks passed"
