#!/usr/bin/env bash
# tools/plots.py's test: each subcommand on a small input written here (in the formats ./train
# and ./plan write) must write a non-empty PNG, and refuse a file of the wrong kind. Needs
# Debian's python3-matplotlib; without it, SKIP. Not part of `make test`, which needs no Python.
set -u
cd "$(dirname "$0")/.."
PY=/usr/bin/python3
if ! [ -x "$PY" ] || ! "$PY" -c "import matplotlib" 2>/dev/null; then
  echo "SKIP: $PY cannot import matplotlib (apt-get install python3-matplotlib)"
  exit 0
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
passed=0 failed=0

check() {  # name, PNG, command...
  local name=$1 png=$2
  shift 2
  if "$@" >"$dir/$name.log" 2>&1 && [ -s "$png" ] && head -c 8 "$png" | grep -q PNG; then
    echo "ok: $name"
    passed=$((passed + 1))
  else
    echo "FAILED: $name"
    sed 's/^/  /' "$dir/$name.log"
    failed=$((failed + 1))
  fi
}

refuses() {  # name, command...: exits non-zero with a line that starts "error:"
  local name=$1
  shift
  if ! "$@" >"$dir/$name.log" 2>&1 && grep -q "^error:" "$dir/$name.log"; then
    echo "ok: $name"
    passed=$((passed + 1))
  else
    echo "FAILED: $name (accepted, or no error line)"
    failed=$((failed + 1))
  fi
}

# Two --log-json files, the second with validation points.
for s in 1 2 3 4; do
  echo "{\"step\":$s,\"loss\":$((10 - s)).5,\"lr\":0.001,\"grad_norm\":1.0}"
done >"$dir/a.jsonl"
for s in 1 2 3 4; do
  echo "{\"step\":$s,\"loss\":$((10 - s)).5,\"lr\":0.001,\"grad_norm\":1.0,\"val_loss\":$((11 - s)).0}"
done >"$dir/b.jsonl"

# A --trace file: 2 ranks, one step of 1F1B on 2 micro-batches.
cat >"$dir/trace.json" <<'EOF'
{"displayTimeUnit":"ms","traceEvents":[
{"name":"process_name","ph":"M","pid":0,"args":{"name":"rank 0"}},
{"name":"process_name","ph":"M","pid":1,"args":{"name":"rank 1"}},
{"name":"F0","ph":"X","pid":0,"tid":0,"ts":0,"dur":10,"cname":"thread_state_running"},
{"name":"F1","ph":"X","pid":0,"tid":0,"ts":10,"dur":10},
{"name":"B0","ph":"X","pid":0,"tid":0,"ts":40,"dur":20},
{"name":"B1","ph":"X","pid":0,"tid":0,"ts":70,"dur":20},
{"name":"step 1 (3 host syncs)","ph":"X","pid":0,"tid":0,"ts":0,"dur":95},
{"name":"F0","ph":"X","pid":1,"tid":0,"ts":10,"dur":10},
{"name":"B0","ph":"X","pid":1,"tid":0,"ts":20,"dur":20},
{"name":"F1","ph":"X","pid":1,"tid":0,"ts":40,"dur":10},
{"name":"B1","ph":"X","pid":1,"tid":0,"ts":50,"dur":20},
{"name":"send_recv","ph":"X","pid":1,"tid":1,"ts":20,"dur":1},
{"name":"step 1 (2 host syncs)","ph":"X","pid":1,"tid":0,"ts":0,"dur":95}]}
EOF

# --report memory,comm as ./train prints them (runtime/report.cu), 2 ranks, ZeRO-1.
cat >"$dir/report.txt" <<'EOF'
step     2/2 | loss 5.5000 | lr 1.00e-03 | norm 1.0000 |     1000 tok/s |     500 tok/s/rank | MFU   1.0% |    10.0 ms
memory per rank (--report memory), ZeRO-1 over dp_cp, N = 2: bytes now; fp32, so 4 per weight, 4 per gradient, 8 per parameter for Adam's m and v
  Ψ = 1000 parameters; each unit (embedding, block, head) splits into N equal shards: Ψ' = N x 502 = 1004, 4 of them padding
  rank            params        grads    optimizer       static   peak activations, workspace
  0                 4016         4016         4016        12048   10.00 KiB, 2.00 KiB
  1                 4016         4016         4016        12048   10.00 KiB, 2.00 KiB
  book              4000         4000         4000        12000   Playbook §4.1: 4Ψ + 4Ψ + 8Ψ/N
  + padding           16           16           16           48   the formula at Ψ' - Ψ
  = padded          4016         4016         4016        12048   the formula at Ψ', what every rank should hold
  every rank holds exactly the formula's bytes at Ψ': yes
activations per block and micro-batch (--report memory; tp 1, recompute none, flash attention, stored in fp32):
  measured 5.00 KiB (5120 B), formula 5.00 KiB (5120 B), equal
communication per step (--report comm; averaged over 2 steps, validation and checkpoints included):
  counted at each call on rank 0: calls, and elements (floats of its data argument); charged by formula: bytes each rank sent
  group    N  collective           calls       elements  bytes (formula)    min..max, ranks
  dp_cp    2  all_reduce             1.0         1004.0          3.92 KiB 3.92 KiB..3.92 KiB
  gradient sync over dp_cp, K = 4 bytes x 1000 parameters = 3.91 KiB:
    ring all-reduce 2(N-1)K/N = 3.91 KiB per rank per step (naive, bucket: all_reduce; ring: send_recv)
ZeRO-1 traffic per training step over dp_cp (N = 2; averaged over 2 steps; validation and checkpoint gathers excluded):
  collective           calls          bytes     expected          bytes
  reduce_scatter         1.0           2008            1           2008
  all_gather             1.0           2008            1           2008
  total                                4016                        4016
EOF

# ./plan --campaign ... --json: two models, two node counts, one cell where nothing fits.
cat >"$dir/campaign.json" <<'EOF'
[{"model":"1B","nodes":1,"best":{"layout":"dp 4 tp 1 pp 2","dp":4,"tp":1,"sp":false,"pp":2,"zero":1,"mbs":4,"grad_acc":16,"mfu":0.44,"memory_gb":40},
  "book":{"dp":4,"tp":1,"pp":2,"zero":1,"mbs":4,"grad_acc":16,"mfu":0.443,"memory_gb":41.8,"predicted_mfu":0.43,"planner_rank":2}},
 {"model":"1B","nodes":2,"best":{"layout":"dp 8 tp 1 pp 2","dp":8,"tp":2,"sp":true,"pp":1,"zero":0,"mbs":1,"grad_acc":32,"mfu":0.41,"memory_gb":19},"book":null},
 {"model":"70B","nodes":1,"best":null,"book":null},
 {"model":"70B","nodes":2,"best":{"layout":"dp 2 tp 8 pp 1","dp":2,"tp":8,"sp":true,"pp":1,"zero":1,"mbs":1,"grad_acc":64,"mfu":0.30,"memory_gb":70},"book":null}]
EOF

P=tools/plots.py
check loss "$dir/loss.png" \
  "$PY" $P loss "$dir/a.jsonl" "$dir/b.jsonl" --labels "dp 2" "tp 2" -o "$dir/loss.png"
check schedule "$dir/schedule.png" "$PY" $P schedule "$dir/trace.json" -o "$dir/schedule.png"
check "schedule --ticks" "$dir/ticks.png" \
  "$PY" $P schedule "$dir/trace.json" --ticks --step 1 -o "$dir/ticks.png"
check memory "$dir/memory.png" "$PY" $P memory "$dir/report.txt" -o "$dir/memory.png"
check comm "$dir/comm.png" "$PY" $P comm "$dir/report.txt" -o "$dir/comm.png"
check heatmap "$dir/heatmap.png" "$PY" $P heatmap "$dir/campaign.json" -o "$dir/heatmap.png"
refuses "loss refuses a trace" "$PY" $P loss "$dir/trace.json" -o "$dir/x.png"
refuses "schedule refuses a log" "$PY" $P schedule "$dir/campaign.json" -o "$dir/x.png"
refuses "memory refuses a log" "$PY" $P memory "$dir/a.jsonl" -o "$dir/x.png"
refuses "heatmap refuses a log" "$PY" $P heatmap "$dir/trace.json" -o "$dir/x.png"
refuses "schedule refuses a step it lacks" \
  "$PY" $P schedule "$dir/trace.json" --step 2 -o "$dir/x.png"
refuses "a missing file" "$PY" $P loss "$dir/none.jsonl" -o "$dir/x.png"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
