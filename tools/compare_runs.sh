#!/usr/bin/env bash
# compare_runs.sh: proves that a change of structure changed no number. `record DIR` trains a
# fixed list of layouts and dtypes (below) a few steps each and keeps, per run, every step's
# loss, gradient norm and validation loss (--log-json, timings dropped), the first step's whole
# gradients (--save-grads) and the final checkpoint (config.json, model.safetensors,
# optimizer.safetensors). `compare A B` says, run by run, whether two recordings are
# byte-identical, and exits 1 on the first that is not.
#
#   bash tools/compare_runs.sh record /tmp/before     # on the old tree (after `make train`)
#   bash tools/compare_runs.sh record /tmp/after      # on the new tree
#   bash tools/compare_runs.sh compare /tmp/before /tmp/after
#   bash tools/compare_runs.sh record-parity /tmp/parity_before   # every parity matrix row and
#   bash tools/compare_runs.sh compare-parity /tmp/parity_before /tmp/parity_after  # reference
#
# About 10 minutes on two cores (the 16-rank run is most of it). `record DIR NAME...` records
# only the named runs.
set -uo pipefail
cd "$(dirname "$0")/.."

# name | ranks | flags (on top of COMMON). The layouts of the parity matrix, one of each kind.
RUNS=(
  "single_gradacc4|1|--grad-acc 4"
  "dp2_naive|2|--dp 2 --grad-acc 2 --dp-sync naive"
  "dp2_bucket|2|--dp 2 --grad-acc 2 --dp-sync bucket --bucket-mb 0.05"
  "dp2_ring|2|--dp 2 --grad-acc 2 --dp-sync ring --bucket-mb 0.05"
  "dp2_no_overlap|2|--dp 2 --grad-acc 2 --no-overlap"
  "zero1_dp2|2|--dp 2 --grad-acc 2 --zero 1"
  "zero2_dp2|2|--dp 2 --grad-acc 2 --zero 2"
  "zero3_dp2|2|--dp 2 --grad-acc 2 --zero 3"
  "zero3_dp2_no_overlap|2|--dp 2 --grad-acc 2 --zero 3 --no-overlap"
  "tp2_sp|2|--tp 2 --sp --grad-acc 2"
  "tp2|2|--tp 2 --grad-acc 2"
  "tp4_kv_replicated|4|--tp 4 --grad-acc 2"
  "pp2_afab|2|--pp 2 --grad-acc 4 --pp-schedule afab"
  "pp2_1f1b|2|--pp 2 --grad-acc 4 --pp-schedule 1f1b"
  "pp2_interleaved|2|--pp 2 --grad-acc 4 --pp-schedule interleaved --pp-virtual 2"
  "pp2_zb_h1|2|--pp 2 --grad-acc 4 --pp-schedule zb-h1"
  "cp2_zigzag_ring|2|--cp 2 --grad-acc 2"
  "cp2_allgather|2|--cp 2 --grad-acc 2 --cp-comm allgather --cp-balance contiguous"
  "naive_selective|1|--attention naive --recompute selective --grad-acc 2"
  "gpt_flash|1|--norm layernorm --mlp gelu --dropout 0.1 --grad-acc 2"
  "gpt_cp2|2|--norm layernorm --mlp gelu --dropout 0.1 --cp 2 --grad-acc 2"
  "bf16_gpt|1|--dtype bf16 --norm layernorm --mlp gelu --dropout 0.1 --grad-acc 2"
  "bf16_gpt_naive|1|--dtype bf16 --norm layernorm --mlp gelu --dropout 0.1 --attention naive --grad-acc 2"
  "recompute_full|1|--recompute full --grad-acc 2"
  "tied|1|--tie-embeddings --grad-acc 2"
  "bf16|1|--dtype bf16 --grad-acc 2 --save-dtype bf16"
  "bf16_full_recompute|1|--dtype bf16 --recompute full --attention naive --grad-acc 2"
  "bf16_dp2_zero1_bf16grads|2|--dtype bf16 --dp 2 --zero 1 --grad-acc-dtype bf16 --grad-acc 2"
  "bf16_dp2_bucket_bf16grads|2|--dtype bf16 --dp 2 --grad-acc-dtype bf16 --grad-acc 2 --bucket-mb 0.05"
  "bf16_zero2_bf16grads|2|--dtype bf16 --dp 2 --zero 2 --grad-acc-dtype bf16 --grad-acc 2"
  "bf16_zero3|2|--dtype bf16 --dp 2 --zero 3 --grad-acc 2"
  "bf16_pp2_zb_bf16grads|2|--dtype bf16 --pp 2 --pp-schedule zb-h1 --grad-acc-dtype bf16 --grad-acc 4"
  "bf16_tp2_sp|2|--dtype bf16 --tp 2 --sp --grad-acc 2"
  "bf16_tied_cp2|2|--dtype bf16 --tie-embeddings --cp 2 --grad-acc 2"
  "bf16_moe_ep2|2|--dtype bf16 --experts 4 --top-k 2 --dp 2 --ep 2 --grad-acc 2"
  "bf16_moe_tp2_sp_full|2|--dtype bf16 --experts 4 --top-k 2 --tp 2 --sp --recompute full --grad-acc 2"
  "fp16_tp2|2|--dtype fp16 --tp 2 --grad-acc 2"
  "fp16_overflow|1|--dtype fp16 --fault inf:0:2 --grad-acc 2"
  "fp8|1|--dtype fp8 --grad-acc 2"
  "fp8_tp2_sp|2|--dtype fp8 --tp 2 --sp --grad-acc 2"
  "fp8_moe_zb|2|--dtype fp8 --experts 4 --top-k 2 --pp 2 --pp-schedule zb-h1 --grad-acc 4"
  "dp2_pp2_tp2_zero1|8|--dp 2 --pp 2 --tp 2 --sp --zero 1 --grad-acc 2"
  "dp2_pp2_cp2_tp2_sp_zero1|16|--dp 2 --pp 2 --cp 2 --tp 2 --sp --zero 1 --grad-acc 2"
  # Resumes: a run stopped after 3 steps (--stop-after), loaded into other layouts and dtypes
  # (@NAME is the checkpoint of the run NAME, recorded before).
  "half_single|1|--grad-acc 4 --stop-after 3"
  "resume_single|1|--grad-acc 4 --load @half_single"
  "resume_zero3_dp2|2|--dp 2 --zero 3 --grad-acc 2 --load @half_single"
  "resume_zero1_bf16_dp2|2|--dp 2 --zero 1 --dtype bf16 --grad-acc 2 --load @half_single"
  "resume_tp2_sp_pp2|4|--tp 2 --sp --pp 2 --grad-acc 4 --load @half_single"
  "resume_bf16_dp2|2|--dp 2 --dtype bf16 --grad-acc 2 --load @half_single"
  # The reports (--report), each as printed, less its measured times (reports.txt).
  "reports_moe_ep2_pp2|4|--experts 4 --top-k 2 --dp 2 --ep 2 --pp 2 --grad-acc 2 --report memory,comm,bubble,experts,sync"
  "reports_tp2_sp_zero1|4|--dp 2 --tp 2 --sp --zero 1 --grad-acc 2 --report memory,comm,sync"
  "reports_cp2_interleaved|4|--cp 2 --pp 2 --pp-schedule interleaved --pp-virtual 2 --grad-acc 4 --report memory,comm,bubble,balance,sync"
  "reports_bf16_zero3_selective|2|--dtype bf16 --dp 2 --zero 3 --attention naive --recompute selective --report memory,comm,sync"
)
COMMON="--device cpu --d-model 64 --layers 4 --heads 4 --kv-heads 2 --ffn 128 --seq 32 --mbs 2"
COMMON+=" --steps 5 --warmup 2 --val-every 2 --val-seqs 8 --lr 3e-3"

mpirun_flags=(--oversubscribe)
[ "$(id -u)" -eq 0 ] && mpirun_flags+=(--allow-run-as-root)
export OMPI_MCA_btl_vader_single_copy_mechanism=none OPENBLAS_NUM_THREADS=1

record_one() {  # dir name ranks flags
  local out=$1/$2 np=$3 flags=$4
  flags=${flags//@/$1/}  # @NAME: that run's directory
  flags=$(echo "$flags" | sed -E "s#(--load [^ ]+)#\1/ckpt#")
  rm -rf "$out" && mkdir -p "$out"
  local cmd="./train $COMMON $flags --log-json $out/log.raw --save-grads $out/grads.safetensors --save $out/ckpt"
  if [ "$np" -gt 1 ]; then cmd="mpirun ${mpirun_flags[*]} -np $np $cmd"; fi
  if ! $cmd >"$out/stdout.txt" 2>"$out/stderr.txt"; then
    echo "  $2: FAILED (exit $?), see $out/stderr.txt"
    return 1
  fi
  # Timings vary from run to run; everything else must not.
  sed -E 's/,?"(tokens_per_s|tokens_per_s_per_rank|mfu)":[^,}]*//g' "$out/log.raw" >"$out/log.jsonl" &&
    rm "$out/log.raw"
  grep -E "^step .*(loss|scale)" "$out/stdout.txt" |
    sed -E 's/\| +[0-9]+ tok\/s \| +[0-9]+ tok\/s\/rank \| MFU +[0-9.]+% \| +[0-9.]+ ms//' >"$out/steps.txt"
  if [[ $flags == *--report* ]]; then  # after the last step's lines; measured times dropped
    awk '/^step /{n=NR} {l[NR]=$0} END{for(i=n+1;i<=NR;i++) print l[i]}' "$out/stdout.txt" |
      grep -vE '^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+%|time ms$|^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+$' |
      grep -v '^saved ' |  # and the workspace's peaks, which ZeRO-3's prefetch makes timing-dependent
      sed -E 's/^(  workspace +).*/\1.../; s/(iB|[0-9] B), [0-9.]+ [KMG]?i?B$/\1, .../' >"$out/reports.txt"
  fi
  rm "$out/stdout.txt" "$out/stderr.txt"
  echo "  $2: $(wc -l <"$out/log.jsonl") steps recorded"
}

case ${1:-} in
  record)
    dir=${2:?usage: compare_runs.sh record DIR [NAME...]}
    shift 2
    mkdir -p "$dir"
    [ -x ./train ] || { echo "build ./train first (make train)"; exit 1; }
    failed=0
    for run in "${RUNS[@]}"; do
      IFS='|' read -r name np flags <<<"$run"
      if [ $# -gt 0 ] && [[ ! " $* " == *" $name "* ]]; then continue; fi
      record_one "$dir" "$name" "$np" "$flags" || failed=1
    done
    exit $failed
    ;;
  compare)
    a=${2:?usage: compare_runs.sh compare DIR_A DIR_B} b=${3:?usage: compare_runs.sh compare DIR_A DIR_B}
    differ=0 same=0 missing=0
    for run in "${RUNS[@]}"; do
      IFS='|' read -r name _ <<<"$run"
      [ -d "$a/$name" ] || continue
      if [ ! -d "$b/$name" ]; then echo "not recorded in $b: $name"; missing=$((missing + 1)); continue; fi
      if diff -rq "$a/$name" "$b/$name" >/dev/null 2>&1; then
        same=$((same + 1))
      else
        echo "DIFFERS: $name"
        diff -rq "$a/$name" "$b/$name" | sed 's/^/  /'
        differ=$((differ + 1))
      fi
    done
    echo "$same runs byte-identical, $differ differ${missing:+, $missing not compared}"
    [ "$differ" -eq 0 ]
    ;;
  record-parity)
    # The parity matrix's rows and their references (tests/parity_rows.cuh), run by the hidden
    # test case of tests/test_parity.cu, which keeps what each wrote.
    dir=${2:?usage: compare_runs.sh record-parity DIR}
    [ -x build/unit_tests ] || { echo "build build/unit_tests first"; exit 1; }
    rm -rf "$dir" && mkdir -p "$dir"
    [ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    PARITY_RECORD_DIR=$(realpath "$dir") build/unit_tests "[.record]" --use-colour no | tail -3
    echo "$(ls "$dir" | wc -l) runs recorded"
    ;;
  compare-parity)
    a=${2:?usage: compare_runs.sh compare-parity DIR_A DIR_B} b=${3:?usage: compare_runs.sh compare-parity DIR_A DIR_B}
    if diff -rq "$a" "$b"; then echo "$(ls "$a" | wc -l) runs byte-identical, 0 differ"
    else echo "DIFFERS (above)"; exit 1; fi
    ;;
  *)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
