#!/usr/bin/env bash
# `make bench`: the single-process step benchmark; collectives, data-parallel and ZeRO steps
# under mpirun on 2 and 4 ranks; tensor, pipeline and context parallelism; naive against
# flash attention; the GPU chapter's matmul ladder against BLAS (cuBLAS on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none
build/bench_step
mpirun --oversubscribe -np 2 build/bench_comm
mpirun --oversubscribe -np 4 build/bench_comm --bandwidth-only
mpirun --oversubscribe -np 4 build/bench_comm --zero-only
mpirun --oversubscribe -np 4 build/bench_tp
build/bench_attention
build/bench_matmul

# Pipeline parallelism on 4 CPU ranks: step time and each stage's idle share, measured (wall
# clock) and in schedule ticks, next to the book's formula (--report bubble).
echo
echo "pipeline parallelism: tiny model with 8 blocks on --pp 4, mbs 4 (mean of steps 2-4)"
printf "| %-11s | %3s | %8s | %-27s | %-27s | %6s |\n" schedule m "step ms" \
  "idle measured (stage 0..3)" "idle ticks (stage 0..3)" book
for sched in afab 1f1b interleaved zb-h1; do
  for m in 4 8 16; do
    extra=""; [ "$sched" = interleaved ] && extra="--pp-virtual 2"
    out=$(OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -np 4 ./train --model tiny --layers 8 \
          --pp 4 --pp-schedule "$sched" $extra --grad-acc "$m" --mbs 4 --steps 4 --warmup 1 \
          --val-every 0 --val-seqs 1 --report bubble 2>&1)
    echo "$out" | awk -v s="$sched" -v m="$m" '
      /^step +[0-9]+\/4 \| loss/ { n++; if (n > 1) { ms += $(NF - 1); k++ } }
      /^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+%/ { meas = meas sep $4; ticks = ticks sep $5; book = $6; sep = " " }
      END { printf "| %-11s | %3d | %8.1f | %-27s | %-27s | %6s |\n", s, m, ms / (k ? k : 1), meas, ticks, book }'
  done
done
echo "ticks are exact (the tables run against each other; a whole backward costs two forwards,"
echo "zb-h1's B and W one each); the wall clock on"
echo "CPU ranks sharing two cores also counts time-slicing and communication."

# Context parallelism on 2 and 4 CPU ranks: step time and each rank's attention time per step,
# zig-zag against contiguous chunks (--report balance).
echo
echo "context parallelism: tiny model, seq 2048, mbs 1 (mean of steps 2-3)"
printf "| %-10s | %2s | %8s | %-40s |\n" split cp "step ms" "attention ms per cp rank (0..cp-1)"
for cp in 2 4; do
  for split in zigzag contiguous; do
    out=$(OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -np "$cp" ./train --model tiny --seq 2048 \
          --mbs 1 --cp "$cp" --cp-balance "$split" --steps 3 --warmup 1 --val-every 0 \
          --val-seqs 1 --report balance 2>&1)
    echo "$out" | awk -v s="$split" -v cp="$cp" '
      /^step +[0-9]+\/3 \| loss/ { n++; if (n > 1) { ms += $(NF - 1); k++ } }
      /^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+$/ { t = t sep $4; sep = " " }
      END { printf "| %-10s | %2d | %8.1f | %-40s |\n", s, cp, ms / (k ? k : 1), t }'
  done
done
echo "contiguous chunks load the last rank most (it attends to every earlier block); zig-zag"
echo "gives every rank the same pairs. On two shared cores the ranks also wait for each other."

# The meta device at the book's scale (docs/meta-device.md): one process runs a step of a 70B
# model's rank at tp 8 x pp 8 (a simulated world of 64), counted, not computed; its wall time and
# peak resident memory (the target: under a minute and under 1 GiB).
echo
echo "meta device: llama-70b, tp 8 + sp x pp 8, grad-acc 16, one step of rank 0 of 64"
/usr/bin/time -f "| wall %e s | peak resident %M KiB |" ./train --model llama-70b --device meta \
  --tp 8 --sp --pp 8 --grad-acc 16 --mbs 1 --simulate-world 64 --simulate-rank 0 --steps 1 \
  --val-every 0 2>&1 | grep -E "^\| wall|^step +1/1 \| loss"
# The book's campaign through the meta device: each cell's book memory beside the meta run's.
echo
bash tools/meta_campaign.sh

# The planner's step-time ranking against measured runs (docs/planner-checks.md).
echo
bash tools/plan_check.sh
