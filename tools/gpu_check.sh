#!/usr/bin/env bash
# gpu_check.sh: one call on a GPU machine (`make gpu-check`). Sets up, then runs every GPU test,
# the CUDA-vs-CPU training comparison, short CUDA training runs of tiny and medium, the step,
# collective and FlashAttention benchmarks (the last against PyTorch's flash backend) and,
# where the machine allows, compute-sanitizer; prints a summary table LAST, always. A failing or
# stuck step is recorded (each has a timeout) and the next one runs.
#
# Setup: with gpu_bundle/ (made beforehand by tools/gpu_bundle.sh and carried over),
# tools/gpu_unpack.sh unpacks the binaries, libraries, corpus and OpenMPI tree under the work
# folder (OpenMPI at a private prefix, found through OPAL_PREFIX: the image's own MPI, if any, is
# left alone), and the libraries the binaries need (readelf's NEEDED entries) that neither the
# bundle nor the system provides, cuBLAS and NCCL, are looked up by those exact names in the CUDA
# toolkit or the Python wheels' nvidia/* folders. Without gpu_bundle/ it builds here, which needs
# picoscale's build dependencies. Nothing is written outside the work folder and $OUT.
#
# Usage: bash tools/gpu_check.sh [--budget SECONDS] [--work DIR] [--dry-run]
#   --budget: total seconds (default 480). A step whose estimate (ESTIMATE below) does not fit
#     in what is left is skipped, and one cut short by the end of the budget is recorded as
#     skipped, not failed (its own timeout is a failure).
#   --work: the work folder (default: a new one under /tmp).
#   --dry-run: runs nothing; charges each step its estimate against the budget and prints what
#     would run, the skips and the table (tools/test_gpu_check.sh uses it on machines without a GPU).
# Logs: $OUT/gpu_check_summary.txt, $OUT/gpu_check_console.log and $OUT/gpu_check_logs.tar.gz
# (one log per step) when OUT is set, else the same files in the work folder.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUDGET=480 WORK="" DRY_RUN=0
while [ $# -gt 0 ]; do
  case $1 in
    --budget) BUDGET=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) echo "gpu_check: unknown argument $1 (usage: tools/gpu_check.sh [--budget SECONDS]" \
            "[--work DIR] [--dry-run])"; exit 2 ;;
  esac
done
if [ -n "$WORK" ]; then mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd); else
  WORK=$(mktemp -d /tmp/picoscale-gpu-check.XXXXXX); fi
LOGS=$WORK/logs
DEST=${OUT:-$WORK}
mkdir -p "$LOGS" "$DEST"
START=$(date +%s)
RESULTS=()  # "name|PASS/FAIL/SKIP|seconds|detail"
NO_RUN=""   # set when setup fails: every later step is recorded as skipped, with this reason
STEP_RC=0 STEP_SECONDS=0 STEP_CUT=0 CHARGED=0
SMALL="--d-model 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128 --seq 32 --mbs 4 --warmup 2 --val-seqs 8 --dtype fp32"
# Seconds each step is expected to take on one H100/H200 (estimates, not measurements: the
# README's table of steps repeats them). A step without an entry is expected to take its cap.
declare -A ESTIMATE=(
  [device_info]=5 [setup]=15 [libraries]=5 [mpi_singleton]=5 [unit_gpu_sync]=60 [unit_gpu]=40
  [train_cuda_vs_cpu]=60 [mpi_gpu_np1]=20 [nccl_timeout]=15 [mpi_gpu_np2]=30 [dp2_vs_grad_acc2]=30 [train_tiny]=20
  [train_medium]=40 [bench]=90 [bench_comm]=40 [memcheck]=100 [racecheck]=60 [racecheck_tp]=40
  [unit_gpu_flash]=40 [dtype_llama1b]=150 [flash_bench]=120 [flash_torch]=90 [racecheck_flash]=60
)

elapsed() { echo $(($(date +%s) - START + CHARGED)); }
record() {  # name result seconds detail
  local detail=${4//|//}  # (| separates the table's columns)
  RESULTS+=("$1|$2|$3|$detail")
  printf '== %-28s %-4s %4ss  %s\n' "$1" "$2" "$3" "$detail"
  # Saved after every step, so a run cut short still leaves its logs behind.
  tar -czf "$DEST/gpu_check_logs.tar.gz" -C "$WORK" logs 2>/dev/null
}
# run_step NAME CAP_SECONDS COMMAND...: runs COMMAND (output in $LOGS/NAME.log) under a timeout
# of CAP, or of what is left of the budget when that is less (then STEP_CUT=1); sets STEP_RC
# (124 on timeout) and STEP_SECONDS. Returns 1 without running it, the step recorded as skipped,
# when its estimate does not fit in what is left, after a failed setup, or in a dry run.
run_step() {
  local name=$1 cap=$2 left t0 estimate
  shift 2
  STEP_RC=0 STEP_SECONDS=0 STEP_CUT=0
  estimate=${ESTIMATE[$name]:-$cap}
  if [ -n "$NO_RUN" ]; then
    record "$name" SKIP 0 "$NO_RUN"
    return 1
  fi
  left=$((BUDGET - $(elapsed) - 10))  # 10 s kept for the table and the tarball
  if [ "$estimate" -gt "$left" ]; then
    record "$name" SKIP 0 "needs ~${estimate}s, ${left}s left of --budget $BUDGET"
    return 1
  fi
  [ "$cap" -gt "$left" ] && cap=$left STEP_CUT=1
  local what="$*"
  if [ "$DRY_RUN" = 1 ]; then
    echo "-- $name (dry run, timeout ${cap}s): $what"
    CHARGED=$((CHARGED + estimate))
    record "$name" SKIP 0 "dry run: would run ~${estimate}s (timeout ${cap}s): ${what:0:100}"
    return 1
  fi
  echo "-- $name (timeout ${cap}s): ${what:0:160}"
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" >"$LOGS/$name.log" 2>&1
  STEP_RC=$?
  STEP_SECONDS=$(($(date +%s) - t0))
  return 0
}
# A failed step shows the end of its log on the console (the whole log is in the tarball).
show_tail() { echo "   --- last lines of $1.log:"; tail -n "${2:-15}" "$LOGS/$1.log" | sed 's/^/   | /'; }
fail() {  # name detail
  local why=$2
  if [ "$STEP_RC" -eq 124 ] || [ "$STEP_RC" -eq 137 ]; then
    if [ "$STEP_CUT" = 1 ]; then  # stopped by the budget, not by its own limit
      record "$1" SKIP "$STEP_SECONDS" "stopped at the end of --budget $BUDGET after ${STEP_SECONDS}s"
      return
    fi
    why="timed out after ${STEP_SECONDS}s; $why"
  fi
  record "$1" FAIL "$STEP_SECONDS" "$why"
  show_tail "$1"
}

# Catch2's last summary line: "All tests passed (A assertions in N test cases)" or
# "test cases: N | P passed | F failed". Sets CASES_OK and CASES_TEXT.
catch_result() {
  local log=$1 line
  line=$(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)
  CASES_TEXT=${line:-no Catch2 summary (crashed?)}
  CASES_TEXT=$(echo "$CASES_TEXT" | sed 's/  */ /g')
  CASES_OK=0
  [[ $line == All\ tests\ passed* ]] && CASES_OK=1
  SKIPS=$(grep -ciE "SKIP" "$log")  # "SKIP: no CUDA device", "no CUDA device: skipped"
}
catch_step() {  # name cap command...: a Catch2 binary; a SKIP (no CUDA seen) is a failure here
  local name=$1
  run_step "$@" || return
  catch_result "$LOGS/$name.log"
  if [ "$STEP_RC" -eq 0 ] && [ "$CASES_OK" -eq 1 ] && [ "$SKIPS" -eq 0 ]; then
    record "$name" PASS "$STEP_SECONDS" "$CASES_TEXT"
  else
    fail "$name" "$CASES_TEXT, exit $STEP_RC, $SKIPS SKIP lines"
  fi
}
# "step N/M | loss L | ... | T tok/s | ..." lines of ./train: first and last loss, median tok/s
# of the steps after the first (which pays for warm-up).
train_stats() {
  grep -E '^step .* tok/s' "$1" | awk -F'|' '
    { gsub(/[^0-9.]/, "", $2); loss[NR] = $2; split($5, a, " "); tok[NR] = a[1] }
    END {
      if (NR == 0) { print "no step lines"; exit }
      n = 0; for (i = (NR > 1 ? 2 : 1); i <= NR; i++) v[++n] = tok[i]
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
      printf "loss %s -> %s over %d steps, %.0f tok/s (median)", loss[1], loss[NR], NR, v[int((n + 1) / 2)]
    }'
}
json_losses() { grep -o '"loss":[^,}]*' "$1" 2>/dev/null | cut -d: -f2; }

{
# ---------------------------------------------------------------------------------------------
echo "picoscale GPU check in $ROOT, budget ${BUDGET}s, work folder $WORK, logs to $DEST"
GPU="no GPU"
if [ "$DRY_RUN" = 1 ]; then
  record environment SKIP 0 "dry run: the machine is not examined"
elif ! nvidia-smi -L >"$LOGS/environment.log" 2>&1; then
  record environment FAIL 0 "no NVIDIA GPU visible (nvidia-smi -L failed)"
  NO_RUN="no GPU visible"
else
  GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
  {
    nvidia-smi
    echo "OS: $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown}"), $(ldd --version | head -1)"
    command -v nvcc && nvcc --version
    echo "CPUs: $(nproc)"
  } >"$LOGS/environment.log" 2>&1
  record environment PASS 0 "$GPU; $(ldd --version | head -1 | grep -o '[0-9.]*$' | sed 's/^/glibc /')"
fi

# ---- setup: unpack the bundle under the work folder (or build here) ----
BINARIES="train build/unit_tests build/mpi_tests build/bench_step build/bench_comm build/bench_attention build/device_info"
ENV_FILE=""
if [ -d gpu_bundle ]; then
  RUNDIR=$WORK/root ENV_FILE=$WORK/env.sh
  SETUP_DETAIL="unpacked gpu_bundle under $WORK ($(sed -n 2p gpu_bundle/MANIFEST.txt 2>/dev/null))"
  run_step setup 120 bash tools/gpu_unpack.sh gpu_bundle "$WORK"
else
  RUNDIR=$ROOT
  SETUP_DETAIL="built here (no gpu_bundle/)"
  run_step setup 400 bash -c "export PATH=\$PATH:/usr/local/cuda/bin; make -j\$(nproc) $BINARIES"
fi
if [ $? -eq 0 ]; then
  if [ "$STEP_RC" -eq 0 ]; then record setup PASS "$STEP_SECONDS" "$SETUP_DETAIL"
  else fail setup "$SETUP_DETAIL: failed"; NO_RUN="setup failed"; fi
elif [ "$DRY_RUN" = 0 ] && [ -z "$NO_RUN" ]; then
  NO_RUN="setup skipped"
fi
# The default corpus: the bundle carries it as one file (the same bytes), else the system's.
DATA=""
[ -f "$WORK/corpus.txt" ] && DATA="--data $WORK/corpus.txt"

# ---- the libraries the binaries need, by the names they ask for ----
# Each NEEDED entry (readelf -d) of the binaries, and of the libraries found for them, that
# neither the bundle (lib/) nor the system's loader cache provides is looked up by exactly that
# name: first in a folder already chosen (so libcublasLt comes from libcublas's folder), then in
# the CUDA toolkit, /opt, and the Python wheels (nvidia/*/lib). Every candidate is logged.
search_dirs="/usr/local /opt /usr/lib /usr/lib64"
for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
  case " $search_dirs " in *" $d "*) ;; *) search_dirs="$search_dirs $d" ;; esac
done
needed_of() { for f in "$@"; do readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; done; }
LIBDIRS=${ENV_FILE:+$WORK/lib} MISSING=""
declare -A LIB_SEEN=()
resolve_libraries() {
  local queue next lib dir d candidates
  queue=$(cd "$RUNDIR" 2>/dev/null && needed_of $BINARIES | sort -u)
  while [ -n "$queue" ]; do
    next=""
    for lib in $queue; do
      [ -n "${LIB_SEEN[$lib]:-}" ] && continue
      LIB_SEEN[$lib]=1
      [ -n "$ENV_FILE" ] && [ -e "$WORK/lib/$lib" ] && continue
      ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l { found = 1 } END { exit !found }' && continue
      dir=""
      for d in ${LIBDIRS//:/ }; do [ -e "$d/$lib" ] && { dir=$d; break; }; done
      if [ -z "$dir" ]; then
        candidates=$(find $search_dirs \( -type f -o -type l \) -name "$lib" 2>/dev/null)
        echo "$lib: candidates: ${candidates:-none}" >>"$LOGS/libraries_search.log"
        dir=$(echo "$candidates" | head -1 | xargs -r dirname)
      fi
      if [ -z "$dir" ]; then MISSING="$MISSING $lib"; continue; fi
      echo "$lib: $dir" >>"$LOGS/libraries_search.log"
      case ":$LIBDIRS:" in *":$dir:"*) ;; *) LIBDIRS="$LIBDIRS:$dir" ;; esac
      next="$next $(needed_of "$dir/$lib")"
    done
    queue=$(echo $next | tr ' ' '\n' | sort -u)
  done
}
[ "$DRY_RUN" = 1 ] || [ -n "$NO_RUN" ] || resolve_libraries

# Our binaries (and mpirun, whose ranks inherit it) run with the bundle's OpenMPI and libraries
# first; the machine's own tools (python, tar) keep theirs, so this wrapper sets them per command.
RUN=$WORK/run
cat >"$RUN" <<EOF
#!/bin/sh
${ENV_FILE:+. $ENV_FILE}
export LD_LIBRARY_PATH="${LIBDIRS#:}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One node: shared memory (no CMA, which VMs and containers often forbid), launched without ssh.
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_pml=ob1 OMPI_MCA_plm=isolated
export PMIX_MCA_gds=hash NCCL_DEBUG=\${NCCL_DEBUG:-WARN}
exec "\$@"
EOF
chmod +x "$RUN"
MPIRUN="$RUN mpirun --oversubscribe --bind-to none"
cd "$RUNDIR" 2>/dev/null || [ "$DRY_RUN" = 1 ] || [ -n "$NO_RUN" ] || NO_RUN="no folder $RUNDIR"

# ---- what the machine is: driver, runtime, device, memory, pools, libraries ----
if run_step device_info 30 "$RUN" build/device_info; then
  if [ "$STEP_RC" -eq 0 ]; then
    record device_info PASS "$STEP_SECONDS" "$(grep -m1 '^device 0' "$LOGS/device_info.log" | cut -c1-150)"
    sed 's/^/   | /' "$LOGS/device_info.log"
  else
    fail device_info "exit $STEP_RC: $(grep -m1 'no usable' "$LOGS/device_info.log")"
  fi
fi

# ---- libraries resolve, and MPI starts as one process (a singleton spawns orted) ----
if run_step libraries 30 bash -c "for b in $BINARIES; do echo \"\$b:\"; $RUN ldd \$b; done"; then
  not_found=$(grep "not found" "$LOGS/libraries.log" | awk '{print $1}' | sort -u | tr '\n' ' ')
  if [ -z "$not_found$MISSING" ] && [ "$STEP_RC" -eq 0 ]; then
    record libraries PASS "$STEP_SECONDS" "outside the bundle and system: ${LIBDIRS:-none}"
  else
    fail libraries "missing:${MISSING:- none by name}; ldd not found: ${not_found:-none} (searched $search_dirs)"
  fi
fi
if run_step mpi_singleton 60 "$RUN" ./train --help; then
  if [ "$STEP_RC" -eq 0 ] && grep -q -- "--device" "$LOGS/mpi_singleton.log"; then
    record mpi_singleton PASS "$STEP_SECONDS" "./train --help: MPI_Init as one process works"
  else
    fail mpi_singleton "./train --help exited $STEP_RC"
  fi
fi

# ---- the kernel tests, first synchronising after every launch (a fault names its kernel) ----
catch_step unit_gpu_sync 180 "$RUN" build/unit_tests "[gpu]~a CUDA training run*" \
  --sync-launches --use-colour no

# ---- every kernel against its CPU reference; CUDA training against the CPU run ----
# ...then as training runs them, asynchronously.
catch_step unit_gpu 180 "$RUN" build/unit_tests "[gpu]~[flash]~a CUDA training run*" --use-colour no
catch_step unit_gpu_flash 120 "$RUN" build/unit_tests "[flash][gpu]" --use-colour no
catch_step train_cuda_vs_cpu 150 "$RUN" build/unit_tests "a CUDA training run*" --use-colour no

# ---- collectives and vocab-parallel cross-entropy on device buffers: 1 rank, 2 ranks on one GPU ----
# One rank runs every NCCL case over one-rank communicators (--comm nccl gives groups of one a
# communicator): a SKIP there is a failure. Two ranks on one GPU cannot use NCCL: those skip.
for np in 1 2; do
  name=mpi_gpu_np$np
  run_step $name 150 $MPIRUN -np $np build/mpi_tests "[gpu]" --use-colour no || continue
  catch_result "$LOGS/$name.log"
  nccl_skip=$(grep -c "SKIP: NCCL needs one GPU per rank" "$LOGS/$name.log")
  other_skips=$((SKIPS - nccl_skip))
  [ "$np" = 1 ] && other_skips=$SKIPS
  note=""
  [ "$nccl_skip" -gt 0 ] && note=" ($nccl_skip NCCL cases skipped: $np ranks share one GPU, so MPI staging ran)"
  if [ "$STEP_RC" -eq 0 ] && [ "$CASES_OK" -eq 1 ] && [ "$other_skips" -eq 0 ] &&
     grep -q "^mpi ranks failed: 0" "$LOGS/$name.log"; then
    record $name PASS "$STEP_SECONDS" "$CASES_TEXT$note"
  else
    fail $name "$CASES_TEXT, exit $STEP_RC, $other_skips unexpected SKIP lines"
  fi
  # ---- right after one rank: NCCL's timeout path. An all-reduce whose input never becomes
  # ready (a kernel spins 120 s on the compute stream) must end the job by --comm-timeout 2:
  # the message, ncclCommAbort (given at most 10 s), MPI_Abort; not when the kernel lets go.
  [ "$np" = 1 ] || continue
  run_step nccl_timeout 60 $MPIRUN -np 1 build/mpi_tests "[.stuck-nccl]" --use-colour no || continue
  abort_note=""
  grep -q "ncclCommAbort did not return" "$LOGS/nccl_timeout.log" &&
    abort_note="; ncclCommAbort did not return within 10 s (it waits for the spinning stream)"
  if [ "$STEP_RC" -ne 0 ] && [ "$STEP_RC" -ne 124 ] && [ "$STEP_SECONDS" -lt 25 ] &&
     grep -q "all_reduce on world, 4 B did not finish within 2s (--comm-timeout)" "$LOGS/nccl_timeout.log"; then
    record nccl_timeout PASS "$STEP_SECONDS" "a stuck NCCL all-reduce ended the job after ${STEP_SECONDS}s (--comm-timeout 2)$abort_note"
  else
    fail nccl_timeout "exit $STEP_RC after ${STEP_SECONDS}s (want: non-zero, under 25 s, the timeout message)$abort_note"
  fi
done

# ---- data parallelism on one GPU: dp 2 (MPI staging) equals grad-acc 2 in one process ----
if run_step dp2_vs_grad_acc2 120 bash -c "set -e
    $RUN ./train --device cuda $SMALL $DATA --steps 5 --grad-acc 2 --log-json $LOGS/acc2.jsonl
    $MPIRUN -np 2 ./train --device cuda $SMALL $DATA --steps 5 --dp 2 --comm-timeout 60 \
      --log-json $LOGS/dp2.jsonl"; then
  worst=$(paste <(json_losses "$LOGS/acc2.jsonl") <(json_losses "$LOGS/dp2.jsonl") | awk '
    { d = $1 - $2; if (d < 0) d = -d; r = d / ($1 < 0 ? -$1 : $1); if (r > w) w = r; n++ }
    END { if (n < 5) print "missing"; else printf "%.2g", w }')
  # Same global batch, other summation orders (MPI sum of two ranks, GPU atomics): ~1e-6.
  if [ "$STEP_RC" -eq 0 ] && [ "$worst" != missing ] && awk -v w="$worst" 'BEGIN { exit !(w <= 1e-4) }'; then
    record dp2_vs_grad_acc2 PASS "$STEP_SECONDS" "5 steps, largest relative loss difference $worst (limit 1e-4)"
  else
    fail dp2_vs_grad_acc2 "exit $STEP_RC, largest relative loss difference ${worst:-?} (limit 1e-4)"
  fi
fi

# ---- CUDA training runs: tokens per second ----
for model in tiny medium; do
  steps=30; [ $model = medium ] && steps=10
  name=train_$model
  run_step $name 150 "$RUN" ./train --device cuda --model $model $DATA --steps $steps \
    --val-every 0 --val-seqs 8 || continue
  stats=$(train_stats "$LOGS/$name.log")
  if [ "$STEP_RC" -eq 0 ] && [[ $stats == loss* ]]; then
    record $name PASS "$STEP_SECONDS" "$stats"
  else
    fail $name "exit $STEP_RC; $stats"
  fi
done

# ---- the same llama-1b step in fp32, bf16 and fp8: tokens/s and MFU (Playbook §Mixed precision) ----
# MFU = tokens/s x (6N + 12 L h s) FLOPs per token (the book's count) over the GPU's dense peak
# for the format (H100/H200 SXM: fp32 67, bf16 989, fp8 1979 TFLOP/s); the bf16 target is 50%.
if run_step dtype_llama1b 240 bash -c "for d in fp32 bf16 fp8; do echo \"== dtype \$d\"; $RUN ./train --device cuda \
    --model llama-1b --dtype \$d --mbs 1 --steps 4 --warmup 1 --val-every 0 --val-seqs 1 $DATA || exit 1; done"; then
  mfu=$(awk '
    /^== dtype/ { d = $3 }
    /\| parameters/ { split($0, a, "|"); split(a[3], b, " "); n = b[1] }
    /^step .* tok\/s/ { split($0, f, "|"); split(f[5], t, " "); tok[d] = t[1] }
    /^fp8 GEMMs on rank 0:/ { fp8 = $6 " native, " $10 " emulated" }
    END {
      peak["fp32"] = 67e12; peak["bf16"] = 989e12; peak["fp8"] = 1979e12
      flops = 6 * n + 12 * 16 * 2048 * 2048  # llama-1b: L 16, h 2048, s 2048
      for (d in tok) printf "%s %.0f tok/s MFU %.1f%%; ", d, tok[d], 100 * tok[d] * flops / peak[d]
      if (fp8 != "") printf "fp8 GEMMs %s; ", fp8
    }' "$LOGS/dtype_llama1b.log")
  if [ "$STEP_RC" -eq 0 ] && [ -n "$mfu" ]; then
    record dtype_llama1b PASS "$STEP_SECONDS" "$mfu (bf16 target 50%)"
  else fail dtype_llama1b "exit $STEP_RC; ${mfu:-no step lines}"; fi
fi

# ---- benchmarks: one training step (CPU and GPU), all-reduce bandwidth on 2 ranks ----
if run_step bench 200 "$RUN" build/bench_step; then
  rows=$(grep -E '^\| (tiny|medium) +\| cuda' "$LOGS/bench.log" | awk -F'|' '
    { gsub(/ /, "", $2); gsub(/ /, "", $6); gsub(/ /, "", $7); gsub(/ /, "", $9)
      printf "%s%s %s tok/s, %s GFLOP/s, %s of sgemm", (NR > 1 ? "; " : ""), $2, $6, $7, $9 }')
  if [ "$STEP_RC" -eq 0 ] && [ -n "$rows" ]; then record bench PASS "$STEP_SECONDS" "$rows"
  else fail bench "exit $STEP_RC; ${rows:-no cuda rows}"; fi
fi
if run_step bench_comm 200 $MPIRUN -np 2 build/bench_comm --bandwidth-only; then
  rows=$(awk -F'|' '
    /^all-reduce bandwidth/ { split($0, h, ", "); what = h[3] "/" substr(h[4], 1, index(h[4], " ") - 1) }
    /^\| +256.00 MiB/ { gsub(/ /, "", $3); gsub(/ /, "", $6)
      printf "%s%s %s %s GB/s", (n++ ? "; " : ""), what, $3, $6 }' "$LOGS/bench_comm.log")
  if [ "$STEP_RC" -eq 0 ] && [ -n "$rows" ]; then record bench_comm PASS "$STEP_SECONDS" "busbw at 256 MiB: $rows"
  else fail bench_comm "exit $STEP_RC; ${rows:-no 256 MiB rows}"; fi
fi

# ---- FlashAttention TFLOP/s, ours (fp32, bf16) and PyTorch's flash backend (bf16), same shapes ----
flash_rows() { grep -E "^\| $1 +\| $2 " "$LOGS/$3.log" | tr -d ' ' | cut -d'|' -f4-7; }  # hd|T|fwd|bwd
if run_step flash_bench 240 "$RUN" build/bench_attention --cuda-only; then
  rows=$(flash_rows ours bf16 flash_bench | awk -F'|' '$2 == 16384 { printf "%shd %s: fwd %s bwd %s", (n++ ? "; " : ""), $1, $3, $4 }')
  f32=$(flash_rows ours fp32 flash_bench | awk -F'|' '$2 == 16384 { printf "%shd %s: fwd %s bwd %s", (n++ ? "; " : ""), $1, $3, $4 }')
  if [ "$STEP_RC" -eq 0 ] && [ -n "$rows" ]; then
    record flash_bench PASS "$STEP_SECONDS" "TFLOP/s at T 16k, bf16 $rows; fp32 $f32"
  else fail flash_bench "exit $STEP_RC; ${rows:-no bf16 rows}"; fi
fi
# The machine's own python and PyTorch (not the bundle's libraries); exit 3: no PyTorch there.
if run_step flash_torch 240 python3 tools/flash_bench_torch.py; then
  if [ "$STEP_RC" -eq 3 ]; then record flash_torch SKIP "$STEP_SECONDS" "$(head -1 "$LOGS/flash_torch.log")"
  elif [ "$STEP_RC" -ne 0 ]; then fail flash_torch "exit $STEP_RC"
  else
    # Per (hd, T): ours / PyTorch's, forward and backward; targets 60% and 50% on every row.
    detail=$(join -t'|' <(flash_rows ours bf16 flash_bench | awk -F'|' '{print $1"/"$2"|"$3"|"$4}' | sort) \
                        <(flash_rows torch bf16 flash_torch | awk -F'|' '{print $1"/"$2"|"$3"|"$4}' | sort) | awk -F'|' '
      { f = $2 / $4; b = $3 / $5; if (n++ == 0 || f < fmin) fmin = f; if (n == 1 || b < bmin) bmin = b
        if ($1 ~ /\/16384$/) last = last sprintf("; hd %s: fwd %.0f%% bwd %.0f%%", substr($1, 1, index($1, "/") - 1), 100 * f, 100 * b) }
      END { if (n == 0) { print "no rows to compare"; exit }
            printf "targets %s: ours / PyTorch worst fwd %.0f%% bwd %.0f%% over %d shapes (targets 60%%, 50%%)%s", (fmin >= 0.6 && bmin >= 0.5 ? "met" : "NOT met"), 100 * fmin, 100 * bmin, n, last }')
    if [[ $detail == "targets met"* ]]; then record flash_torch PASS "$STEP_SECONDS" "$detail"
    else record flash_torch FAIL "$STEP_SECONDS" "$detail"; fi
  fi
fi

# ---- compute-sanitizer, where the machine supports it (Firecracker yes, gVisor no) ----
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
  /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
sanitize() {  # name cap tool binary tests (an MPI binary runs as one process: a singleton)
  local name=$1 cap=$2 tool=$3 binary=$4 tests=$5 summary
  if [ -z "$SANITIZER" ]; then record "$name" SKIP 0 "compute-sanitizer not found"; return; fi
  run_step "$name" "$cap" "$RUN" "$SANITIZER" --tool "$tool" --error-exitcode 9 \
    "$binary" "$tests" --use-colour no || return
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$LOGS/$name.log" | tail -1 | sed 's/^=* *//')
  if grep -qiE "device not supported|not supported on this|unable to .*initialize" "$LOGS/$name.log"; then
    record "$name" SKIP "$STEP_SECONDS" "compute-sanitizer does not support this machine"
  elif [ "$STEP_RC" -eq 0 ] && [ -n "$summary" ]; then
    record "$name" PASS "$STEP_SECONDS" "$summary"
  else
    fail "$name" "exit $STEP_RC; ${summary:-no sanitizer summary}"
  fi
}
sanitize memcheck 150 memcheck build/unit_tests "[gpu]~a CUDA training run*"
# The kernels that reduce through shared memory (racecheck looks at nothing else).
sanitize racecheck 120 racecheck build/unit_tests "CUDA rmsnorm*,CUDA cross-entropy*,CUDA sum*"
sanitize racecheck_flash 150 racecheck build/unit_tests "CUDA FlashAttention*"
sanitize racecheck_tp 90 racecheck build/mpi_tests "CUDA vocab-parallel*"

# ---- summary, last ----
passed=0 failed=0 skipped=0
summary=$DEST/gpu_check_summary.txt
{
  echo
  echo "== picoscale GPU check: $GPU; $(sed -n 2p gpu_bundle/MANIFEST.txt 2>/dev/null || git rev-parse --short HEAD 2>/dev/null); $(elapsed)s"
  echo "| step | result | s | detail |"
  echo "|---|---|---|---|"
} >"$summary"
for r in ${RESULTS[@]+"${RESULTS[@]}"}; do
  IFS='|' read -r name result secs detail <<<"$r"
  echo "| $name | $result | $secs | $detail |" >>"$summary"
  case $result in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
done
echo "$passed passed, $failed failed, $skipped skipped (logs: $DEST)" >>"$summary"
cat "$summary"
tar -czf "$DEST/gpu_check_logs.tar.gz" -C "$WORK" logs 2>/dev/null
[ "$failed" -eq 0 ]
} 2>&1 | tee "$LOGS/console.log"
status=${PIPESTATUS[0]}
cp "$LOGS/console.log" "$DEST/gpu_check_console.log" 2>/dev/null
exit "$status"
