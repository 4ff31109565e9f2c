#!/usr/bin/env bash
# `make bench`, the planner against measured runs: 12 layouts of the medium model on 4 CPU
# ranks (8 sequences per step), each run in four rounds and timed (the median of the 8 timed
# steps, steps 2 and 3 of each run), and predicted by ./plan with the collectives bench_comm
# --fit measured and the mean of the GEMM rates bench_comm --rates measured between the rounds
# (one probe of a few seconds finds this machine anywhere between one and two cores' worth);
# then Spearman's rank correlation between the two orders (the target: 0.8 or more) and where
# they disagree, also for predictions from the probes beside each round and from the first
# fit's alone. About 30 minutes; every run's steps and every probe stay in build/plan_check/.
# PLAN_CHECK_LAYOUTS=FILE: other layouts, one per line (./train's flags; 8 sequences a step);
# PLAN_CHECK_ROUNDS=N: other than 4 rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none OPENBLAS_NUM_THREADS=1
fit=build/comm_fit_cpu4.json
mpirun --oversubscribe -np 4 build/bench_comm --fit "$fit" | tail -5
# Layouts whose step times, as the planner predicts them, spread over 1.7 times the fastest
# (in two groups; the faster, the six without full recomputation or 4 stages, within 5% of each
# other at the measured half width, where the machine decides much of their order: its runs of
# one layout spread by 10-20%); together they cover ZeRO-1 and -3, tp,
# sp, the AFAB, 1F1B and interleaved schedules, cp, and full recomputation.
layouts=(
  "--dp 4 --zero 1 --mbs 2 --grad-acc 1"
  "--dp 2 --pp 2 --mbs 1 --grad-acc 4"
  "--dp 2 --tp 2 --mbs 2 --grad-acc 2"
  "--tp 2 --pp 2 --pp-schedule interleaved --pp-virtual 2 --mbs 2 --grad-acc 4"
  "--dp 2 --tp 2 --sp --mbs 1 --grad-acc 4"
  "--cp 4 --mbs 2 --grad-acc 4"
  "--dp 4 --zero 3 --recompute full --mbs 2 --grad-acc 1"
  "--dp 4 --recompute full --mbs 1 --grad-acc 2"
  "--pp 4 --pp-schedule 1f1b --mbs 1 --grad-acc 8"
  "--tp 4 --recompute full --mbs 4 --grad-acc 2"
  "--pp 4 --pp-schedule afab --mbs 2 --grad-acc 4"
  "--pp 4 --pp-schedule afab --recompute full --mbs 2 --grad-acc 4"
)
if [ -n "${PLAN_CHECK_LAYOUTS:-}" ]; then mapfile -t layouts < <(grep . "$PLAN_CHECK_LAYOUTS"); fi
work=build/plan_check
rm -rf "$work" && mkdir -p "$work"
predict() {  # layout, fit: the predicted step in ms
  ./plan --gpu cpu --gpus-per-node 4 --model medium --comm-fit "$2" --layout "$1 --dtype fp32" |
    awk '/^predicted step:/ { printf "%.1f", $3 * 1000 }'
}
probes=0
probe() {  # the GEMM rates now, in the next probe file
  cp "$fit" "$work/probe$probes.json"
  mpirun --oversubscribe -np 4 build/bench_comm --rates "$work/probe$probes.json" >/dev/null
  probes=$((probes + 1))
}
# Rounds over the layouts in four orders (forward, backward, then both from the middle): a slow
# spell of the machine falls on several layouts rather than on one, and a drift through the
# check weighs on every layout alike. Each run is short (2 timed steps after a first): a layout
# is sampled in 4 spells of the machine rather than 2. A GEMM probe before the first round and
# after every round (beside a run: the mean of the predictions with the probes around its round).
rounds=${PLAN_CHECK_ROUNDS:-4}
n=${#layouts[@]}
times=() predictions=()
probe
for round in $(seq "$rounds"); do
  case $((round % 4)) in
    1) order=($(seq 0 $((n - 1)))) ;;
    2) order=($(seq $((n - 1)) -1 0)) ;;
    3) order=($(seq $((n / 2)) $((n - 1))) $(seq 0 $((n / 2 - 1)))) ;;
    0) order=($(seq $((n / 2 - 1)) -1 0) $(seq $((n - 1)) -1 $((n / 2)))) ;;
  esac
  for i in "${order[@]}"; do
    ms=$(mpirun --oversubscribe -np 4 ./train --device cpu --model medium ${layouts[$i]} --dtype fp32 \
           --steps 3 --warmup 1 --val-every 0 --val-seqs 1 2>&1 |
         awk '/^step +[0-9]+\/3 \| loss/ { n++; if (n > 1) print $(NF - 1) }')
    times[$i]="${times[$i]:-} $ms"
    echo "$round	$i	$((probes - 1))	$probes	$(echo $ms)" >>"$work/runs.tsv"
  done
  probe
  for i in "${order[@]}"; do
    before=$(predict "${layouts[$i]}" "$work/probe$((probes - 2)).json")
    after=$(predict "${layouts[$i]}" "$work/probe$((probes - 1)).json")
    predictions[$i]="${predictions[$i]:-} $(awk -v a="$before" -v b="$after" 'BEGIN { printf "%.1f", (a + b) / 2 }')"
  done
done
median() { tr ' ' '\n' | { grep . || true; } | sort -g | awk '{ v[NR] = $1 } END {
  if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
build/bench_comm --mean "$work/mean_rates.json" "$work"/probe*.json | sed -n 1p
echo "medium on 4 CPU ranks, 8 sequences per step: step time measured (median of steps 2-3 over $rounds runs) and"
echo "predicted with the probes' mean rates; with the probes beside each round (median over the rounds); with the first fit's"
printf "| %-72s | %11s | %12s | %11s | %11s |\n" layout "measured ms" "predicted ms" "beside" "first fit"
rows=$(mktemp)
for i in "${!layouts[@]}"; do
  l=${layouts[$i]}
  measured=$(echo "${times[$i]:-}" | median)
  predicted=$(predict "$l" "$work/mean_rates.json")
  beside=$(echo "${predictions[$i]:-}" | median)
  first=$(predict "$l" "$fit")
  printf "| %-72s | %11s | %12s | %11s | %11s |\n" "$l" "$measured" "$predicted" "$beside" "$first"
  echo "$measured $predicted $beside $first" >>"$rows"
done
# Spearman: 1 - 6 sum d^2 / (n (n^2 - 1)) over the ranks of two columns (ties: mean rank).
spearman() {  # column of the prediction, label; prints rho and the layouts 3 or more ranks apart
  awk -v col="$1" -v label="$2" '
    { m[NR] = $1; p[NR] = $col }
    function ranks(v, r,   i, j, less, same) {
      for (i = 1; i <= NR; i++) { less = 0; same = 0
        for (j = 1; j <= NR; j++) { if (v[j] < v[i]) less++; else if (v[j] == v[i]) same++ }
        r[i] = less + (same + 1) / 2 }
    }
    END {
      ranks(m, rm); ranks(p, rp)
      for (i = 1; i <= NR; i++) d += (rm[i] - rp[i]) ^ 2
      rho = 1 - 6 * d / (NR * (NR * NR - 1))
      printf "Spearman rank correlation over %d layouts, %s: %.3f (target 0.8)\n", NR, label, rho
      for (i = 1; i <= NR; i++) if ((rm[i] - rp[i]) ^ 2 >= 9)
        printf "  layout %d: measured rank %.1f, predicted rank %.1f\n", i, rm[i], rp[i]
    }' "$rows"
}
spearman 2 "the probes' mean rates"
spearman 3 "the probes beside each round"
spearman 4 "the first fit's rates"
rm -f "$rows"
