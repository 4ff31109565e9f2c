#!/usr/bin/env bash
# `make bench`, the planner against measured runs: 12 layouts of the medium model on 4 CPU
# ranks (8 sequences per step), each timed (the median of steps 2-4 over two rounds, about 18
# minutes) and predicted by ./plan with this machine's sgemm rate and the collectives
# bench_comm --fit measured; then Spearman's rank correlation between the two orders (the
# target: 0.8 or more) and where they disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none OPENBLAS_NUM_THREADS=1
fit=build/comm_fit_cpu4.json
mpirun --oversubscribe -np 4 build/bench_comm --fit "$fit" | tail -5
layouts=(
  "--dp 4 --mbs 1 --grad-acc 2"
  "--dp 4 --zero 1 --mbs 2 --grad-acc 1"
  "--dp 4 --zero 3 --mbs 1 --grad-acc 2"
  "--dp 2 --tp 2 --mbs 2 --grad-acc 2"
  "--dp 2 --tp 2 --sp --mbs 1 --grad-acc 4"
  "--tp 4 --mbs 4 --grad-acc 2"
  "--pp 4 --pp-schedule 1f1b --mbs 1 --grad-acc 8"
  "--pp 4 --pp-schedule afab --mbs 2 --grad-acc 4"
  "--dp 2 --pp 2 --mbs 1 --grad-acc 4"
  "--tp 2 --pp 2 --pp-schedule interleaved --pp-virtual 2 --mbs 2 --grad-acc 4"
  "--cp 4 --mbs 2 --grad-acc 4"
  "--dp 4 --recompute full --mbs 1 --grad-acc 2"
)
# Two rounds over the layouts, so that a slow spell of the machine falls on several layouts
# rather than on one; a layout's step time is the median of steps 2-4 of its two runs.
rounds=${PLAN_CHECK_ROUNDS:-2}
times=()
for round in $(seq "$rounds"); do
  for i in "${!layouts[@]}"; do
    ms=$(mpirun --oversubscribe -np 4 ./train --device cpu --model medium ${layouts[$i]} --dtype fp32 \
           --steps 4 --warmup 1 --val-every 0 --val-seqs 1 2>&1 |
         awk '/^step +[0-9]+\/4 \| loss/ { n++; if (n > 1) print $(NF - 1) }')
    times[$i]="${times[$i]:-} $ms"
  done
done
median() { tr ' ' '\n' | { grep . || true; } | sort -g | awk '{ v[NR] = $1 } END {
  if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo
echo "medium on 4 CPU ranks, 8 sequences per step: step time measured (median of steps 2-4 over $rounds runs) and predicted"
printf "| %-72s | %12s | %12s |\n" layout "measured ms" "predicted ms"
rows=$(mktemp)
for i in "${!layouts[@]}"; do
  l=${layouts[$i]}
  measured=$(echo "${times[$i]:-}" | median)
  predicted=$(./plan --gpu cpu --gpus-per-node 4 --model medium --comm-fit "$fit" \
                --layout "$l --dtype fp32" | awk '/^predicted step:/ { printf "%.1f", $3 * 1000 }')
  printf "| %-72s | %12s | %12s |\n" "$l" "$measured" "$predicted"
  echo "$measured $predicted" >>"$rows"
done
# Spearman: 1 - 6 sum d^2 / (n (n^2 - 1)) over the ranks of the two columns (ties: mean rank).
awk '
  { m[NR] = $1; p[NR] = $2 }
  function ranks(v, r,   i, j, less, same) {
    for (i = 1; i <= NR; i++) { less = 0; same = 0
      for (j = 1; j <= NR; j++) { if (v[j] < v[i]) less++; else if (v[j] == v[i]) same++ }
      r[i] = less + (same + 1) / 2 }
  }
  END {
    ranks(m, rm); ranks(p, rp)
    for (i = 1; i <= NR; i++) d += (rm[i] - rp[i]) ^ 2
    rho = 1 - 6 * d / (NR * (NR * NR - 1))
    printf "Spearman rank correlation over %d layouts: %.3f (target 0.8)\n", NR, rho
    for (i = 1; i <= NR; i++) if ((rm[i] - rp[i]) ^ 2 >= 9)
      printf "  layout %d: measured rank %.1f, predicted rank %.1f\n", i, rm[i], rp[i]
  }' "$rows"
rm -f "$rows"
