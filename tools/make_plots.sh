#!/usr/bin/env bash
# `make plots`: a few short CPU runs of the tiny model, written to plots/, and every picture of
# tools/plots.py drawn from them (about a minute on two cores). Needs ./train, ./plan and
# Debian's python3-matplotlib (the Makefile sees to all three).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-plots}
PY=/usr/bin/python3
mkdir -p "$OUT"
export OMPI_MCA_btl_vader_single_copy_mechanism=none  # containers often forbid CMA
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OPENBLAS_NUM_THREADS=1
run() {  # ranks, log name, ./train flags...: rank 0's output goes to $OUT/NAME.txt
  local np=$1 name=$2
  shift 2
  echo "  mpirun -np $np ./train $*"
  mpirun --oversubscribe -np "$np" ./train "$@" >"$OUT/$name.txt" 2>&1 ||
    { tail -5 "$OUT/$name.txt"; exit 1; }
}

echo "== one global batch (8 sequences of 64 tokens) on four layouts, 60 steps each"
SHAPE=(--mbs 4 --seq 64 --steps 60 --val-every 10 --val-seqs 16)
run 1 single "${SHAPE[@]}" --grad-acc 2 --log-json "$OUT/single.jsonl"
run 2 dp2 "${SHAPE[@]}" --dp 2 --log-json "$OUT/dp2.jsonl"
run 2 tp2 "${SHAPE[@]}" --tp 2 --grad-acc 2 --log-json "$OUT/tp2.jsonl"
run 2 pp2 "${SHAPE[@]}" --pp 2 --grad-acc 2 --log-json "$OUT/pp2.jsonl"

echo "== pipeline schedules: 4 stages, 8 micro-batches (--trace)"
PIPE=(--pp 4 --grad-acc 8 --mbs 2 --seq 64 --steps 3)
run 4 1f1b "${PIPE[@]}" --trace "$OUT/1f1b.json"
run 4 zb-h1 "${PIPE[@]}" --pp-schedule zb-h1 --trace "$OUT/zb-h1.json"
run 2 interleaved --pp 2 --pp-schedule interleaved --pp-virtual 2 --grad-acc 4 --mbs 2 --seq 64 \
  --steps 3 --trace "$OUT/interleaved.json"

echo "== memory and communication against the formulas: dp 2 x tp 2, ZeRO-1 (--report)"
run 4 report --dp 2 --tp 2 --zero 1 --mbs 2 --seq 64 --steps 2 --report memory,comm

echo "== the planner on the book's campaign"
echo "  ./plan --campaign tests/data/book_campaign.csv --json $OUT/campaign.json"
./plan --campaign tests/data/book_campaign.csv --json "$OUT/campaign.json" >"$OUT/campaign.txt"

echo "== pictures"
P=tools/plots.py
"$PY" $P loss "$OUT"/{single,dp2,tp2,pp2}.jsonl --labels "1 rank, grad-acc 2" "dp 2" \
  "tp 2, grad-acc 2" "pp 2, grad-acc 2" --title "One batch, four layouts: the same loss" \
  -o "$OUT/loss.png"
"$PY" $P schedule "$OUT/1f1b.json" --ticks --title "1F1B, 4 stages, 8 micro-batches (ticks)" \
  -o "$OUT/schedule_1f1b.png"
"$PY" $P schedule "$OUT/1f1b.json" --title "1F1B, 4 stages, 8 micro-batches (measured on CPU)" \
  -o "$OUT/schedule_1f1b_measured.png"
"$PY" $P schedule "$OUT/zb-h1.json" --ticks --title "ZB-H1, 4 stages, 8 micro-batches (ticks)" \
  -o "$OUT/schedule_zb-h1.png"
"$PY" $P schedule "$OUT/interleaved.json" --ticks \
  --title "Interleaved 1F1B, 2 stages x 2 chunks, 4 micro-batches (ticks)" \
  -o "$OUT/schedule_interleaved.png"
"$PY" $P memory "$OUT/report.txt" -o "$OUT/memory.png"
"$PY" $P comm "$OUT/report.txt" -o "$OUT/comm.png"
"$PY" $P heatmap "$OUT/campaign.json" -o "$OUT/heatmap.png"
