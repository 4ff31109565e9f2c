#!/usr/bin/env bash
# meta_campaign.sh: the book's benchmark campaign (Playbook §11.4) through the real code path. For
# every cell that ran (tests/data/book_campaign.csv: the model, the nodes of 8 H100 and the
# book's best layout with what it measured), ./train runs the book's own layout on the meta
# device: one process, a simulated world of dp x tp x pp ranks, every pipeline stage in turn
# (--simulate-rank -1), bf16, seq 4096, tensor parallelism with sequence parallelism, no
# recomputation, as the campaign ran; a tied preset is untied across stages, as nanotron does.
# Prints per cell the book's measured memory per GPU, the meta run's peak (its stage with the
# most), both in GB (10^9 bytes, the book's unit), what the book measured beyond it, and what
# that stage's arena reserved at its peak (live buffers and those held for reuse).
#   bash tools/meta_campaign.sh [CSV]    # about a minute on two cores
set -uo pipefail
cd "$(dirname "$0")/.."
csv=${1:-tests/data/book_campaign.csv}
[ -x ./train ] || { echo "build ./train first (make train)"; exit 1; }
[ -f "$csv" ] || { echo "error: $csv: no such file"; exit 2; }

printf "%-5s %5s  %-34s %9s %9s %9s %9s\n" model nodes "layout (book's best)" "book GB" "meta GB" \
  "book-meta" "reserved"
grep -v '^#' "$csv" | tail -n +2 | while IFS=, read -r model nodes dp tp pp zero mbs ga mfu tok mem; do
  [ -n "$dp" ] || continue  # nothing ran in this cell
  preset=book-$(echo "$model" | tr 'A-Z' 'a-z')
  world=$((dp * tp * pp))
  flags="--model $preset --device meta --dtype bf16 --dp $dp --tp $tp --pp $pp --zero $zero"
  flags+=" --mbs $mbs --grad-acc $ga --steps 1 --val-every 0 --simulate-world $world --simulate-rank -1"
  [ "$tp" -gt 1 ] && flags+=" --sp"
  [ "$pp" -gt 1 ] && [[ $preset == book-1b || $preset == book-3b ]] && flags+=" --untie-embeddings"
  out=$(./train $flags 2>&1)
  if [ $? -ne 0 ]; then
    printf "%-5s %5s  %-34s %9s %9s  %s\n" "$model" "$nodes" "dp $dp tp $tp pp $pp zero $zero" "$mem" \
      "-" "$(echo "$out" | grep -m1 error)"
    continue
  fi
  # The walk's table: the last column of each stage's row is its peak, in human units.
  peak=$(echo "$out" | awk '/^every pipeline stage/ { on = 1; next } on && /^ +[0-9]+ +[0-9]+ / {
      v = $(NF - 1); u = $NF; s = u == "GiB" ? 2^30 : u == "MiB" ? 2^20 : u == "KiB" ? 2^10 : 1
      if (v * s > best) best = v * s } /^the stage with the most/ { on = 0 } END { printf "%.1f", best / 1e9 }')
  # That stage's arena, reserved at its peak: its buffers live or held for reuse (core.cuh).
  reserved=$(echo "$out" | awk '/^  reserved / { v = $2; u = $3
      s = u == "GiB" ? 2^30 : u == "MiB" ? 2^20 : u == "KiB" ? 2^10 : 1; printf "%.1f", v * s / 1e9 }')
  layout="dp $dp tp $tp pp $pp zero $zero mbs $mbs ga $ga"
  printf "%-5s %5s  %-34s %9s %9s %9.1f %9s\n" "$model" "$nodes" "$layout" "$mem" "$peak" \
    "$(echo "$mem - $peak" | bc -l)" "$reserved"
done
