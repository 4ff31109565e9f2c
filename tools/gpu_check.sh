#!/usr/bin/env bash
# gpu_check.sh: one call on a GPU machine (`make gpu-check`). Sets up, then runs every GPU test,
# the CUDA-vs-CPU training comparison, short CUDA training runs of tiny and medium, the step,
# collective and FlashAttention benchmarks (the last against PyTorch's flash backend) and, where the machine allows, compute-sanitizer; prints a summary table
# LAST. A failing or stuck step is recorded (each has a timeout) and the next one runs.
#
# Setup: with gpu_bundle/ (made beforehand by tools/gpu_bundle.sh and carried over) it unpacks
# the binaries, the OpenMPI tree (to /, where OpenMPI looks for it: run as root) and the fortune
# corpus, and finds cuBLAS 13 and NCCL 2 on the machine (CUDA toolkit, or the Python wheels'
# nvidia/* folders). Without gpu_bundle/ it builds, which needs picoscale's build dependencies.
#
# Usage: bash tools/gpu_check.sh [--budget SECONDS] [--unpack-root DIR]
#   --budget: total seconds (default 480); a step that would not fit in what is left is skipped
#   --unpack-root: untar OpenMPI and the corpus there instead of / (to test this script on a
#     machine that has them installed already; the bundle's libraries are still used)
# Logs: $OUT/gpu_check_summary.txt, $OUT/gpu_check_console.log and $OUT/gpu_check_logs.tar.gz
# (one log per step) when OUT is set, else the same files in the work folder it names.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUDGET=480 UNPACK_ROOT=/
while [ $# -gt 0 ]; do
  case $1 in
    --budget) BUDGET=$2; shift 2 ;;
    --unpack-root) UNPACK_ROOT=$2; shift 2 ;;
    *) echo "gpu_check: unknown argument $1 (usage: tools/gpu_check.sh [--budget SECONDS]" \
            "[--unpack-root DIR])"; exit 2 ;;
  esac
done
WORK=$(mktemp -d /tmp/picoscale-gpu-check.XXXXXX)
LOGS=$WORK/logs
DEST=${OUT:-$WORK}
mkdir -p "$LOGS" "$DEST"
START=$(date +%s)
RESULTS=()  # "name|PASS/FAIL/SKIP|seconds|detail"
NO_RUN=""   # set when setup fails: every later step is recorded as skipped, with this reason
SMALL="--d-model 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128 --seq 32 --mbs 4 --warmup 2 --val-seqs 8"

elapsed() { echo $(($(date +%s) - START)); }
record() {  # name result seconds detail
  local detail=${4//|//}  # (| separates the table's columns)
  RESULTS+=("$1|$2|$3|$detail")
  printf '== %-28s %-4s %4ss  %s\n' "$1" "$2" "$3" "$detail"
  # Saved after every step, so a run cut short still leaves its logs behind.
  tar -czf "$DEST/gpu_check_logs.tar.gz" -C "$WORK" logs 2>/dev/null
}
# run_step NAME CAP_SECONDS COMMAND...: runs COMMAND (output in $LOGS/NAME.log) under a timeout of
# CAP or what is left of the budget; sets STEP_RC (124 on timeout) and STEP_SECONDS.
# Returns 1 without running it when less than 20 s would be left.
run_step() {
  local name=$1 cap=$2 left t0
  shift 2
  if [ -n "$NO_RUN" ]; then
    record "$name" SKIP 0 "$NO_RUN"
    return 1
  fi
  left=$((BUDGET - $(elapsed) - 10))
  if [ "$left" -lt 20 ]; then
    record "$name" SKIP 0 "no time left in --budget $BUDGET"
    return 1
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  local what="$*"
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
  [ "$STEP_RC" -eq 124 ] || [ "$STEP_RC" -eq 137 ] && why="timed out after ${STEP_SECONDS}s; $why"
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
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed); nothing to check"
  exit 1
fi
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
{
  nvidia-smi
  echo "OS: $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown}"), $(ldd --version | head -1)"
  command -v nvcc && nvcc --version
  echo "CPUs: $(nproc)"
} >"$LOGS/environment.log" 2>&1
record environment PASS 0 "$GPU; $(ldd --version | head -1 | grep -o '[0-9.]*$' | sed 's/^/glibc /')"

# ---- setup: unpack the bundle (or build), find cuBLAS and NCCL ----
LIBDIRS=""
if [ -d gpu_bundle ]; then
  setup() {
    set -e
    cat gpu_bundle/MANIFEST.txt
    mkdir -p "$UNPACK_ROOT"
    [ -w "$UNPACK_ROOT" ] || { echo "the OpenMPI tree unpacks to $UNPACK_ROOT: run as root"; exit 1; }
    tar -xzf gpu_bundle/openmpi.tar.gz -C "$UNPACK_ROOT"
    tar -xzf gpu_bundle/fortunes.tar.gz -C "$UNPACK_ROOT"
    rm -rf "$WORK/bundle" && mkdir -p "$WORK/bundle" build
    tar -xzf gpu_bundle/lib.tar.gz -C "$WORK/bundle"
    tar -xzf gpu_bundle/bin.tar.gz -C "$WORK/bundle"
    cp "$WORK/bundle/bin/train" .
    cp "$WORK/bundle"/bin/{unit_tests,mpi_tests,bench_step,bench_comm,bench_attention} build/
  }
  run_step setup 120 bash -c "$(declare -f setup); WORK=$WORK UNPACK_ROOT=$UNPACK_ROOT; setup"
  SETUP_DETAIL="unpacked gpu_bundle ($(sed -n 2p gpu_bundle/MANIFEST.txt 2>/dev/null))"
  LIBDIRS=$WORK/bundle/lib
else
  run_step setup 400 bash -c 'export PATH=$PATH:/usr/local/cuda/bin; make -j"$(nproc)" train build/unit_tests build/mpi_tests build/bench_step build/bench_comm build/bench_attention'
  SETUP_DETAIL="built here (no gpu_bundle/)"
fi
if [ "$STEP_RC" -eq 0 ]; then
  record setup PASS "$STEP_SECONDS" "$SETUP_DETAIL"
else
  fail setup "$SETUP_DETAIL: failed"
  NO_RUN="setup failed"
fi

# cuBLAS 13 (with its cublasLt) and NCCL 2: the toolkit's, or the Python wheels' (nvidia/*/lib).
search_dirs="/usr/local /opt /usr/lib /usr/lib64"
for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
  case " $search_dirs " in *" $d "*) ;; *) search_dirs="$search_dirs $d" ;; esac
done
find_lib() { find $search_dirs \( -type f -o -type l \) -name "$1" 2>/dev/null; }
CUBLAS_DIR="" NCCL_DIR=""
for f in $(find_lib libcublas.so.13); do
  [ -e "$(dirname "$f")/libcublasLt.so.13" ] && { CUBLAS_DIR=$(dirname "$f"); break; }
done
NCCL_DIR=$(find_lib libnccl.so.2 | head -1 | xargs -r dirname)
LIBDIRS="$LIBDIRS:$CUBLAS_DIR:$NCCL_DIR"
echo "cuBLAS: ${CUBLAS_DIR:-not found}; NCCL: ${NCCL_DIR:-not found} (searched $search_dirs)" >>"$LOGS/environment.log"

# Our binaries (and mpirun, whose ranks inherit it) run with the bundle's libraries first; the
# machine's own tools (python, tar) keep theirs, so the path is set per command by this wrapper.
RUN=$WORK/run
cat >"$RUN" <<EOF
#!/bin/sh
export LD_LIBRARY_PATH="${LIBDIRS#:}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One node: shared memory (no CMA, which VMs and containers often forbid), launched without ssh.
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_pml=ob1 OMPI_MCA_plm=isolated
export PMIX_MCA_gds=hash NCCL_DEBUG=\${NCCL_DEBUG:-WARN}
exec "\$@"
EOF
chmod +x "$RUN"
MPIRUN="$RUN mpirun --oversubscribe --bind-to none"
[ -x /usr/bin/orterun ] && [ -d gpu_bundle ] && MPIRUN="$RUN /usr/bin/orterun --oversubscribe --bind-to none"

# ---- libraries resolve, and MPI starts as one process (a singleton spawns orted) ----
if run_step libraries 30 bash -c "for b in train build/unit_tests build/mpi_tests build/bench_step build/bench_comm; do echo \"\$b:\"; $RUN ldd \$b; done"; then
  missing=$(grep "not found" "$LOGS/libraries.log" | awk '{print $1}' | sort -u | tr '\n' ' ')
  if [ -z "$missing" ] && [ "$STEP_RC" -eq 0 ]; then
    record libraries PASS "$STEP_SECONDS" "cuBLAS from ${CUBLAS_DIR:-?}, NCCL from ${NCCL_DIR:-?}"
  else
    fail libraries "not found: ${missing:-?} (cuBLAS dir: ${CUBLAS_DIR:-none}, NCCL dir: ${NCCL_DIR:-none})"
  fi
fi
if run_step mpi_singleton 60 "$RUN" ./train --help; then
  if [ "$STEP_RC" -eq 0 ] && grep -q -- "--device" "$LOGS/mpi_singleton.log"; then
    record mpi_singleton PASS "$STEP_SECONDS" "./train --help: MPI_Init as one process works"
  else
    fail mpi_singleton "./train --help exited $STEP_RC"
  fi
fi

# ---- every kernel against its CPU reference; CUDA training against the CPU run ----
catch_step unit_gpu 180 "$RUN" build/unit_tests "[gpu]~[flash]~a CUDA training run*,[cuda]" --use-colour no
catch_step unit_gpu_flash 120 "$RUN" build/unit_tests "[flash][gpu]" --use-colour no
catch_step train_cuda_vs_cpu 150 "$RUN" build/unit_tests "a CUDA training run*" --use-colour no

# ---- collectives and vocab-parallel cross-entropy on device buffers: 1 rank, 2 ranks on one GPU ----
for np in 1 2; do
  name=mpi_gpu_np$np
  run_step $name 150 $MPIRUN -np $np build/mpi_tests "[gpu]" --use-colour no || continue
  catch_result "$LOGS/$name.log"
  nccl_skip=$(grep -c "SKIP: NCCL needs one GPU per rank" "$LOGS/$name.log")
  other_skips=$((SKIPS - nccl_skip))
  note=""
  [ "$nccl_skip" -gt 0 ] && note=" (NCCL case skipped: $np ranks share one GPU, so MPI staging ran)"
  if [ "$STEP_RC" -eq 0 ] && [ "$CASES_OK" -eq 1 ] && [ "$other_skips" -eq 0 ] &&
     grep -q "^mpi ranks failed: 0" "$LOGS/$name.log"; then
    record $name PASS "$STEP_SECONDS" "$CASES_TEXT$note"
  else
    fail $name "$CASES_TEXT, exit $STEP_RC, $other_skips unexpected SKIP lines"
  fi
done

# ---- data parallelism on one GPU: dp 2 (MPI staging) equals grad-acc 2 in one process ----
if run_step dp2_vs_grad_acc2 120 bash -c "set -e
    $RUN ./train --device cuda $SMALL --steps 5 --grad-acc 2 --log-json $LOGS/acc2.jsonl
    $MPIRUN -np 2 ./train --device cuda $SMALL --steps 5 --dp 2 --comm-timeout 60 \
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
  run_step $name 150 "$RUN" ./train --device cuda --model $model --steps $steps --val-every 0 \
    --val-seqs 8 || continue
  stats=$(train_stats "$LOGS/$name.log")
  if [ "$STEP_RC" -eq 0 ] && [[ $stats == loss* ]]; then
    record $name PASS "$STEP_SECONDS" "$stats"
  else
    fail $name "exit $STEP_RC; $stats"
  fi
done

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
for r in "${RESULTS[@]}"; do
  IFS='|' read -r name result secs detail <<<"$r"
  echo "| $name | $result | $secs | $detail |" >>"$summary"
  case $result in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
done
echo "$passed passed, $failed failed, $skipped skipped (logs: $DEST)" >>"$summary"
cat "$summary"
tar -czf "$DEST/gpu_check_logs.tar.gz" -C "$WORK" logs 2>/dev/null
[ "$failed" -eq 0 ]
} 2>&1 | tee "$WORK/console.log"
status=${PIPESTATUS[0]}
cp "$WORK/console.log" "$DEST/gpu_check_console.log" 2>/dev/null
exit "$status"
