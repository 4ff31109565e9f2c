#!/usr/bin/env bash
# Runs every picoscale test and ends with one line of its own: "N passed, N failed, N skipped"
# (test cases). GPU tests run when a CUDA device answers, else they are counted as skipped.
set -u
cd "$(dirname "$0")/.."
UNIT=build/unit_tests
passed=0 failed=0 skipped=0
. tools/catch_log.sh  # SKIP_LINE: how Catch2 prints a skipped case

# Adds one Catch2 run's test-case counts to the totals (from its console summary line).
count() {
  local log=$1 line p f
  line=$(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)
  if [[ $line =~ ^All\ tests\ passed.*in\ ([0-9]+)\ test\ case ]]; then
    p=${BASH_REMATCH[1]} f=0
  elif [[ $line =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ passed\ \|\ +([0-9]+)\ failed ]]; then
    p=${BASH_REMATCH[2]} f=${BASH_REMATCH[3]}
  elif [[ $line =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ failed ]]; then
    p=0 f=${BASH_REMATCH[2]}
  else
    echo "could not read the test summary of $log (did the binary crash?)"
    p=0 f=1
  fi
  # A case that does not apply here ends with a visible "SKIP: why" warning: count it as
  # skipped, not passed.
  local s
  s=$(grep -c -- "$SKIP_LINE" "$log")
  [ "$s" -gt "$p" ] && s=$p
  passed=$((passed + p - s)) failed=$((failed + f)) skipped=$((skipped + s))
}

run_group() {  # name, Catch2 test spec
  local log
  log=$(mktemp)
  echo "== $1"
  "$UNIT" "$2" --durations no --use-colour no 2>&1 | tee "$log" | grep -E "FAILED|SKIP|passed|failed|error" | grep -v "^$"
  count "$log"
  rm -f "$log"
}

if [ ! -x "$UNIT" ] || [ ! -x ./train ] || [ ! -x ./plan ] || [ ! -x build/mpi_tests ] ||
   [ ! -x build/bench_comm ]; then
  echo "build first: make train plan $UNIT build/mpi_tests build/bench_comm"
  echo "0 passed, 1 failed"
  exit 1
fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none  # containers often forbid CMA
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# Collectives under mpirun on 2, 3, 4 and 8 ranks; rank 0 reports for all of them.
run_mpi() {  # ranks [Catch2 test spec, default: the CPU cases]
  local log np=$1 spec=${2:-"~[gpu]"}
  log=$(mktemp)
  echo "== collectives on $np ranks (mpirun -np $np)${2:+, $2}"
  OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -np "$np" build/mpi_tests "$spec" --use-colour no 2>&1 | tee "$log" |
    grep -E "FAILED|SKIP|passed|failed|error" | grep -v "^$"
  count "$log"
  grep -qE "^mpi ranks failed: [1-9]" "$log" && failed=$((failed + 1))
  rm -f "$log"
}

run_group "unit tests (CPU)" "~[gpu]~[train]~[parity]~[sweep]~[record]~[report_width]"
run_group "training runs (CPU)" "[train]"
for np in 2 3 4 8; do run_mpi "$np"; done
run_group "parity matrix and multi-rank runs (CPU, mpirun)" "[parity]"
# The floor check's own test of planted violations (test_floor; the floor itself, `make floor`,
# is CI's check of the tree, not a test: an applied experiment may grow a file); the
# documentation: the chapter map's names and every link (test_links), the change-one-file
# patches (test_experiments), every fenced ./train and mpirun command of the README and the
# guides, shortened to 2 steps (test_docs, a couple of minutes); what ptxas says of every
# kernel (test_kernel_report: no spills, the tensor-core kernels keep ldmatrix, cp.async and
# mma, in the PTX and, with a cuobjdump, in the SASS, else one skipped case; about a minute).
for script in test_floor test_links test_experiments test_docs test_kernel_report; do
  log=$(mktemp)
  echo "== tools/$script.sh"
  if bash "tools/$script.sh" >"$log" 2>&1; then passed=$((passed + 1)); tail -1 "$log"
  else failed=$((failed + 1)); grep -E "FAIL" "$log"; fi
  if grep -q "^SASS: not checked" "$log"; then  # test_kernel_report without a cuobjdump
    echo "SKIP: the SASS counts of test_kernel_report (no cuobjdump; make deps-sass fetches it)"
    skipped=$((skipped + 1))
  fi
  rm -f "$log"
done
# The pictures of tools/plots.py, made headless from inputs written in the test and from short
# runs, each checked by what it draws (tests/test_plots.py, ~30 s); they need Debian's
# python3-matplotlib (`make deps-plots`): without it the case is skipped.
echo "== plots (tests/test_plots.py)"
if ! /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  echo "SKIP: tests/test_plots.py (no python3-matplotlib; make deps-plots installs it)"
  skipped=$((skipped + 1))
else
  log=$(mktemp)
  if /usr/bin/python3 tests/test_plots.py >"$log" 2>&1; then passed=$((passed + 1)); tail -1 "$log"
  else failed=$((failed + 1)); grep -E "FAILED|Error|error" "$log"; fi
  rm -f "$log"
fi
# The GPU check script itself, without a GPU (one case, ~20 s): dry runs, skips and the table,
# and the bundle's OpenMPI unpacked next to another OpenMPI.
log=$(mktemp)
echo "== GPU check script (tools/test_gpu_check.sh)"
if bash tools/test_gpu_check.sh >"$log" 2>&1; then passed=$((passed + 1)); tail -1 "$log"
else failed=$((failed + 1)); grep -E "FAILED|test_gpu_check:" "$log"; fi
rm -f "$log"
if nvidia-smi -L >/dev/null 2>&1; then
  run_group "GPU tests" "[gpu]"
  run_mpi 2 "[gpu]"  # two ranks on the first GPU(s): device buffers over NCCL or staged MPI
else
  n=$(( $("$UNIT" "[gpu]" --list-test-names-only 2>/dev/null | grep -c .) +
         $(build/mpi_tests "[gpu]" --list-test-names-only 2>/dev/null | grep -c .) ))
  echo "SKIP: $n GPU tests (no CUDA device visible on this machine)"
  skipped=$((skipped + n))
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
