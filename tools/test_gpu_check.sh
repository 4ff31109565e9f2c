#!/usr/bin/env bash
# test_gpu_check.sh: checks tools/gpu_check.sh and tools/gpu_unpack.sh on a machine without a GPU
# (one counted case of `make test`, about 20 s). Needs ./train built and Debian's OpenMPI.
#   1. A dry run with a budget too small for every step: it skips the steps that do not fit,
#      lists every step all the same, prints the table last, and writes nothing outside its
#      work folder.
#   2. The plan at the default budget: what only a GPU can tell first (the kernel tests and CUDA
#      training against the CPU, then FlashAttention against PyTorch's SDPA, then llama-1b in
#      three formats, then the matmul ladder against cuBLAS, then the rest); its estimates fit
#      the budget, the budget fits one 600 s command, and the attention benchmark, the llama-1b
#      step and the matmul ladder are inside it.
#   3. Without the bundle, the first line of output says so (dry run and real run).
#   4. A real run with --budget 0: every step skipped (or, without a GPU, the environment failed
#      and the rest skipped), and still the table, not an abort.
#   5. Skipped tests are Catch2's "  SKIP: " lines only (tools/catch_log.sh), not any line with
#      the word in it.
#   6. The OpenMPI of a bundle (tools/gpu_bundle.sh --mpi-only), unpacked under a work folder on
#      a machine whose own OpenMPI is replaced by another one (a broken one, so using it fails),
#      runs `mpirun -np 2 ./train --dp 2` through OPAL_PREFIX, and leaves the other one untouched.
#      The replacement is made in a private mount namespace (unshare -m, bind mounts over the
#      system's OpenMPI folders), so the machine's own OpenMPI is never modified.
# Prints "test_gpu_check: N passed, M failed" last; exit code 0 when nothing failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T=$(mktemp -d /tmp/picoscale-test-gpu-check.XXXXXX)
trap 'rm -rf "$T"' EXIT
passed=0 failed=0
check() {  # description, then a command that succeeds when the claim holds
  local what=$1
  shift
  if "$@"; then passed=$((passed + 1)); echo "ok: $what"
  else failed=$((failed + 1)); echo "FAILED: $what"; fi
}
[ -x ./train ] || { echo "test_gpu_check: build ./train first"; echo "test_gpu_check: 0 passed, 1 failed"; exit 1; }
unset OUT
before=$(git status --porcelain 2>/dev/null)
ls -d /tmp/picoscale-gpu-check.* 2>/dev/null | sort >"$T/tmp_before"

# A bundle as the check sees it before unpacking (a dry run unpacks nothing), and none at all:
# given by --bundle, so neither plan depends on whether this checkout has a gpu_bundle/.
mkdir -p "$T/bundle_stub"
printf 'picoscale GPU bundle (stub)\ncommit: 0000000\n' >"$T/bundle_stub/MANIFEST.txt"
NO_BUNDLE=$T/no_bundle
# Every step, in the order the check must run them: what only a GPU can tell first.
SETUP_STEPS="environment setup device_info libraries mpi_singleton"
FIRST_STEPS="unit_gpu_sync train_cuda_vs_cpu flash_bench flash_torch dtype_llama1b bench_matmul"
REST_STEPS="bench_matmul_8x8 mpi_gpu_np1 nccl_timeout device_timeout unit_gpu unit_gpu_flash memcheck mpi_gpu_np2 dp2_vs_grad_acc2
            train_tiny train_medium bench bench_comm racecheck racecheck_flash racecheck_tp"
table_steps() { grep -E '^\| [a-z_0-9]+ \| (PASS|FAIL|SKIP) \|' "$1" | cut -d'|' -f2 | tr -d ' '; }
# The table lists exactly the steps above, each once, in that order.
in_order() { [ "$(table_steps "$1" | tr '\n' ' ')" = "$(echo $SETUP_STEPS $FIRST_STEPS $REST_STEPS) " ]; }
every_row_says_why() { ! grep -E '^\| [a-z_0-9]+ \| (SKIP|FAIL) \| [0-9]+ \| *\|$' "$1"; }

# ---- 1. dry run: skips what does not fit, table last, writes only in its folder ----
bash tools/gpu_check.sh --dry-run --budget 150 --bundle "$T/bundle_stub" --work "$T/dry" >"$T/dry.log" 2>&1
rc=$?
check "dry run exits 0 (nothing failed)" [ "$rc" -eq 0 ]
check "dry run charges estimates and skips the steps that no longer fit" \
  grep -q "SKIP .*needs ~[0-9]*s, [0-9-]*s left of --budget 150" "$T/dry.log"
check "dry run lists steps it would run" grep -q "dry run: would run" "$T/dry.log"
check "the summary table is the end of the output" \
  bash -c "tail -1 '$T/dry.log' | grep -q '^0 passed, 0 failed, [0-9]* skipped' &&
           grep -q '^| step | result | s | detail |' '$T/dry.log'"
check "the first pass over the kernel tests synchronises after every launch" \
  grep -q "^-- unit_gpu_sync (dry run.*build/unit_tests .*--sync-launches" "$T/dry.log"
check "a short budget still lists every step once, in order (nccl_timeout with mpi_gpu_np1 skipped)" \
  in_order "$T/dry.log"
check "every skipped step says why" every_row_says_why "$T/dry.log"
check "the summary and logs are in the work folder" \
  test -f "$T/dry/gpu_check_summary.txt" -a -f "$T/dry/gpu_check_logs.tar.gz"

# ---- 2. the plan at the default budget ----
bash tools/gpu_check.sh --dry-run --bundle "$T/bundle_stub" --work "$T/plan" >"$T/plan.log" 2>&1
check "the default plan exits 0" [ $? -eq 0 ]
budget=$(sed -n 's/.*, budget \([0-9]*\)s, work folder.*/\1/p' "$T/plan.log" | head -1)
planned=$(grep -o '^| [a-z_0-9]* | SKIP | 0 | dry run: would run ~[0-9]*s' "$T/plan.log" |
          sed 's/.*~\([0-9]*\)s$/\1/' | awk '{ s += $1 } END { print s + 0 }')
echo "   default budget ${budget:-?}s; the estimates of the steps it would run add up to ${planned}s"
# 600 s is the most one command may run; a step cut short at the budget's end may take 10 s
# more (timeout's kill grace), and the table and the tarball a few: 30 s to spare at least.
check "the default budget fits one 600 s command with 30 s to spare" \
  bash -c "[ -n '$budget' ] && [ '$budget' -le 570 ] && [ '$budget' -ge 300 ]"
check "the plan's estimates fit in the budget, 10 s kept for the table" \
  bash -c "[ '$planned' -gt 0 ] && [ \$(( $planned + 10 )) -le '${budget:-0}' ] &&
           grep -q '^plan: [0-9]* of 27 steps would run, estimates ${planned}s + 10s reserve' '$T/plan.log'"
for step in $FIRST_STEPS; do
  check "the default plan runs $step" grep -q "^| $step | SKIP | 0 | dry run: would run" "$T/plan.log"
done
check "the default plan lists every step once, in the order of what only a GPU can tell" \
  in_order "$T/plan.log"
check "every step of the default plan says why it runs or not" every_row_says_why "$T/plan.log"
check "the plan plans the sanitizer steps whether or not this machine has compute-sanitizer" \
  bash -c "! grep -q 'compute-sanitizer not found' '$T/plan.log'"

# ---- 3. no bundle: the first line says so ----
bash tools/gpu_check.sh --dry-run --bundle "$NO_BUNDLE" --work "$T/nob" >"$T/nob.log" 2>&1
check "without the bundle, the first line of a dry run says so and how to make it" \
  bash -c "head -1 '$T/nob.log' | grep -q 'NO BUNDLE: $NO_BUNDLE is missing' &&
           head -1 '$T/nob.log' | grep -q 'tools/gpu_bundle.sh'"
check "with the bundle, the first line names it" \
  bash -c "head -1 '$T/plan.log' | grep -q '^picoscale GPU check: bundle $T/bundle_stub (commit: 0000000)'"
# The sources the bundle records, against the checkout: the same, then one file differing.
mkdir -p "$T/bundle_same" "$T/bundle_stale"
cp "$T/bundle_stub/MANIFEST.txt" "$T/bundle_same/"
cp "$T/bundle_stub/MANIFEST.txt" "$T/bundle_stale/"
git ls-files -- Makefile train.cu model.cu | xargs sha256sum >"$T/bundle_same/SOURCES.sha256"
sed "2s/^[0-9a-f]\{64\}/$(printf '%064d' 0)/" "$T/bundle_same/SOURCES.sha256" >"$T/bundle_stale/SOURCES.sha256"
bash tools/gpu_check.sh --dry-run --budget 0 --bundle "$T/bundle_same" --work "$T/same" >"$T/same.log" 2>&1
bash tools/gpu_check.sh --dry-run --budget 0 --bundle "$T/bundle_stale" --work "$T/stale" >"$T/stale.log" 2>&1
check "the first line says whether the bundle was built from the checkout's sources" \
  bash -c "head -1 '$T/same.log' | grep -q '; built from these sources$' &&
           head -1 '$T/stale.log' | grep -q 'STALE BUNDLE: 1 source files differ from this checkout' &&
           head -1 '$T/plan.log' | grep -q 'sources not recorded'"

# ---- 4. --budget 0: no step runs, no abort before the table ----
bash tools/gpu_check.sh --budget 0 --bundle "$NO_BUNDLE" --work "$T/zero" >"$T/zero.log" 2>&1
check "without the bundle, the first line of a real run says so" \
  bash -c "head -1 '$T/zero.log' | grep -q 'NO BUNDLE'"
check "--budget 0 still prints the table" grep -q '^| step | result | s | detail |' "$T/zero.log"
check "--budget 0 runs no step" \
  bash -c "! grep -E '^\| [a-z_0-9]+ \| PASS' '$T/zero.log' | grep -qv environment &&
           [ \$(grep -cE '^\| [a-z_0-9]+ \| SKIP' '$T/zero.log') -ge 15 ]"
check "--budget 0 lists every step once, in order" in_order "$T/zero.log"
check "neither run wrote into the checkout" [ "$(git status --porcelain 2>/dev/null)" = "$before" ]
ls -d /tmp/picoscale-gpu-check.* 2>/dev/null | sort >"$T/tmp_after"
check "neither run made a folder of its own in /tmp (--work was given)" cmp -s "$T/tmp_before" "$T/tmp_after"

# ---- 4b. each unit_tests filter of the plan selects the cases it means ----
# Catch2 reads "[a]~b*~[c]" otherwise than "[a]~[c]~b*" (the first once selected 2 of 32 cases
# for memcheck): each filter's selection must equal the one made here from simple listings.
if [ -x build/unit_tests ]; then
  # (Catch2 exits with the number of cases it listed)
  names() { { build/unit_tests "$@" --list-test-names-only 2>/dev/null || true; } | grep -v '^$' | sort; }
  names "[gpu]" >"$T/gpu_all"
  names "[large]" >"$T/large"
  names "[flash]" >"$T/flash"
  grep -v '^a CUDA training run' "$T/gpu_all" >"$T/gpu_kernels"
  filter_of() {  # the words between unit_tests and --use-colour, but --sync-launches
    sed -n "s/^-- $1 (dry run.*build\/unit_tests \(.*\) --use-colour.*/\1/p" "$T/plan.log" |
      head -1 | sed 's/ --sync-launches$//'
  }
  selects() {  # step, expected names file
    local f
    f=$(filter_of "$1")
    [ -n "$f" ] && [ -s "$2" ] && names "$f" | cmp -s - "$2"
  }
  comm -23 "$T/gpu_kernels" "$T/large" >"$T/want_memcheck"
  comm -23 "$T/gpu_kernels" "$T/flash" >"$T/want_unit_gpu"
  comm -12 "$T/gpu_all" "$T/flash" >"$T/want_flash"
  check "unit_gpu_sync's filter selects every [gpu] case but the training run" selects unit_gpu_sync "$T/gpu_kernels"
  check "unit_gpu's filter selects those but the [flash] ones" selects unit_gpu "$T/want_unit_gpu"
  check "unit_gpu_flash's filter selects the [flash][gpu] cases" selects unit_gpu_flash "$T/want_flash"
  check "memcheck's filter selects every [gpu] case but the training run and the [large] ones" \
    selects memcheck "$T/want_memcheck"
fi

# ---- 4c. catch_each.sh: each case in a process of its own ----
cat >"$T/fake_catch.sh" <<'FAKE'
#!/usr/bin/env bash
if [ "${2:-}" = "--list-test-names-only" ]; then printf 'one, with a comma\ntwo [bracketed]\n\nthree\n'; exit 3; fi
echo "filter: $1"
[ "$1" = 'two \[bracketed\]' ] && exit 1
[ "$1" = 'three' ] && [ -n "${STUCK:-}" ] && sleep 30
exit 0
FAKE
chmod +x "$T/fake_catch.sh"
bash tools/catch_each.sh env "$T/fake_catch.sh" "[gpu]" >"$T/each_fake.log" 2>&1
check "catch_each runs each listed case alone, its name escaped, and reports each exit" \
  bash -c "[ \"\$(grep -c '^=== case ' '$T/each_fake.log')\" = 3 ] &&
           grep -qx 'filter: one\\\\, with a comma' '$T/each_fake.log' &&
           [ \"\$(grep '^=== exit' '$T/each_fake.log' | tr '\n' ' ')\" = '=== exit 0 === exit 1 === exit 0 ' ]"
t0=$(date +%s)
STUCK=1 CASE_TIMEOUT=1 bash tools/catch_each.sh env "$T/fake_catch.sh" "[gpu]" >"$T/each_stuck.log" 2>&1
check "catch_each stops a stuck case at CASE_TIMEOUT (exit 124) and reports it" \
  bash -c "[ \"\$(grep '^=== exit' '$T/each_stuck.log' | tr '\n' ' ')\" = '=== exit 0 === exit 1 === exit 124 ' ] &&
           [ \$((\$(date +%s) - $t0)) -lt 15 ]"
CASE_TIMEOUT=1.5 bash tools/catch_each.sh env "$T/fake_catch.sh" "[gpu]" >"$T/each_bad.log" 2>&1
bad_rc=$?
check "catch_each refuses a CASE_TIMEOUT that is not whole seconds, exit 2, running nothing" \
  bash -c "[ $bad_rc = 2 ] && grep -q 'CASE_TIMEOUT=1.5: expected whole seconds' '$T/each_bad.log' &&
           ! grep -q '^=== case' '$T/each_bad.log'"
if [ -x build/unit_tests ]; then
  bash tools/catch_each.sh env build/unit_tests "[gpu]~a CUDA training run*" --use-colour no \
    >"$T/each.log" 2>&1
  each_cases=$(grep -c '^=== case ' "$T/each.log")
  check "catch_each's run of every [gpu] case selects exactly one case each time ($each_cases cases)" \
    bash -c "[ '$each_cases' -gt 0 ] &&
             [ \"\$(grep -cE 'in 1 test case\)|test cases: +1 \|' '$T/each.log')\" = '$each_cases' ]"
fi

# ---- 5. what counts as a skipped test ----
# Catch2 prints WARN("SKIP: why") as "<file>:<line>: " and "warning:", then the message indented
# by two spaces (wrapped at 79 columns, each piece indented alike).
cat >"$T/skips.log" <<'EOF'
NCCL INFO Channel 00/0 : skipping the P2P transport: one rank only
NCCL WARN NET/IB : No device found, skip.
SKIP and skipped, in the middle of someone else's line: not a test
-------------------------------------------------------------------------------
CUDA gemm matches the CPU reference
-------------------------------------------------------------------------------
tests/test_ops.cu:441
...............................................................................

tests/cuda_case.cuh:20: 
warning:
  SKIP: no CUDA device (cudaErrorNoDevice: no CUDA-capable device is detected)

===============================================================================
All tests passed (12 assertions in 3 test cases)
EOF
grep -v '^  SKIP: ' "$T/skips.log" >"$T/noskips.log"
skips_of() { (. tools/catch_log.sh; catch_result "$1"; echo "$SKIPS|$CASES_OK|$FIRST_SKIP"); }
check "a Catch2 SKIP line is a skipped test; an NCCL line with 'skip' in it is not" \
  [ "$(skips_of "$T/skips.log")" = "1|1|SKIP: no CUDA device (cudaErrorNoDevice: no CUDA-capable device is detected)" ]
check "lines that merely contain 'skip' count as no skipped test" [ "$(skips_of "$T/noskips.log")" = "0|1|" ]
check "gpu_check.sh and run_tests.sh read SKIP lines through tools/catch_log.sh" \
  bash -c "grep -q '^\. \"\$ROOT/tools/catch_log.sh\"' tools/gpu_check.sh &&
           grep -q '^\. tools/catch_log.sh' tools/run_tests.sh &&
           ! grep -n 'grep -ci.*SKIP' tools/gpu_check.sh"
# The real thing, where this machine has no GPU: a [gpu] case's own output.
if [ -x build/unit_tests ] && ! nvidia-smi -L >/dev/null 2>&1; then
  build/unit_tests "CUDA gemm matches the CPU reference" --use-colour no >"$T/real.log" 2>&1
  check "a [gpu] case on this machine (no GPU) prints one SKIP line that catch_result counts" \
    bash -c "[ \"\$(. tools/catch_log.sh; catch_result '$T/real.log'; echo \$SKIPS)\" = 1 ]"
fi

# ---- 6. unpacking next to another OpenMPI ----
MPI=/usr/lib/x86_64-linux-gnu/openmpi PMIX=/usr/lib/x86_64-linux-gnu/pmix2
if ! bash tools/gpu_bundle.sh --mpi-only "$T/bundle" >"$T/bundle.log" 2>&1; then
  check "gpu_bundle.sh --mpi-only packs OpenMPI" false
  tail -5 "$T/bundle.log"
else
  # Another OpenMPI: plugins and config that break any run that loads them, an mpirun that fails.
  other=$T/other
  mkdir -p "$other/lib/openmpi3" "$other/etc" "$other/pmix/lib/pmix" "$other/share" "$other/bin"
  for f in "$MPI"/lib/openmpi3/mca_{pml_ob1,btl_vader,ess_singleton,plm_isolated}.so; do
    echo "not a plugin: another OpenMPI" >"$other/lib/openmpi3/$(basename "$f")"
  done
  echo "pml = no_such_pml" >"$other/etc/openmpi-mca-params.conf"
  printf '#!/bin/sh\necho "the other OpenMPI ran"; exit 3\n' >"$other/bin/orterun"
  chmod +x "$other/bin/orterun"
  (cd "$other" && find . -type f | sort | xargs md5sum) >"$T/other.md5"
  touch "$T/marker"
  sleep 1
  cat >"$T/inside.sh" <<EOF
set -e
mount --bind "$other/lib" "$MPI/lib"
mount --bind "$other/etc" /etc/openmpi
mount --bind "$other/pmix/lib" "$PMIX/lib"
mount --bind "$other/share" /usr/share/openmpi
mount --bind "$other/bin/orterun" /usr/bin/orterun
mount --bind "$other/bin/orterun" /usr/bin/orted
# The system's mpirun now fails: the check below would pass for the wrong reason otherwise.
if OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 1 true >/dev/null 2>&1; then
  echo "the other OpenMPI is not in place"; exit 4
fi
bash "$ROOT/tools/gpu_unpack.sh" "$T/bundle" "$T/work"
. "$T/work/env.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_plm=isolated PMIX_MCA_gds=hash
echo "mpirun: \$(command -v mpirun)"
ompi_info --path all | grep -E "Pkglibdir|Sysconfdir|Pkgdatadir" | sort -u
cd "$ROOT"
mpirun --oversubscribe -np 2 ./train --device cpu --dp 2 --steps 1 --val-every 0 --d-model 32 \
  --layers 1 --heads 2 --kv-heads 1 --ffn 64 --seq 16 --mbs 2 --warmup 1 --val-seqs 2 \
  --data "$ROOT/README.md"
EOF
  if unshare -m --propagation private true 2>/dev/null; then
    unshare -m --propagation private bash "$T/inside.sh" >"$T/inside.log" 2>&1
    rc=$?
    check "bundled OpenMPI runs 2 ranks from its private prefix, next to another OpenMPI" \
      bash -c "[ $rc -eq 0 ] && grep -q '^step *1/1' '$T/inside.log'"
    check "it was the bundle's mpirun and plugins" \
      bash -c "grep -q 'mpirun: $T/work/openmpi/usr/bin/mpirun' '$T/inside.log' &&
               grep 'Pkglibdir' '$T/inside.log' | grep -q '$T/work/openmpi' &&
               grep 'Sysconfdir' '$T/inside.log' | grep -q '$T/work/openmpi/etc/openmpi'"
    [ "$rc" -eq 0 ] || tail -15 "$T/inside.log"
  else
    echo "note: unshare -m is not permitted here: the other OpenMPI cannot be put in place;" \
         "checking the unpacked tree only"
    bash tools/gpu_unpack.sh "$T/bundle" "$T/work" >"$T/inside.log" 2>&1
    check "the bundle unpacks under its work folder" test -x "$T/work/openmpi/usr/bin/orterun"
  fi
  check "the other OpenMPI is untouched" bash -c "cd '$other' && md5sum --quiet -c '$T/other.md5'"
  check "nothing was written to the system's OpenMPI folders" \
    bash -c "[ -z \"\$(find $MPI $PMIX /etc/openmpi /usr/share/openmpi /usr/bin -newer '$T/marker' 2>/dev/null | head -1)\" ]"
  check "the unpacked tree has no links out of its folder" \
    bash -c "[ -z \"\$(find '$T/work' -type l -lname '/*' | head -1)\" ]"
fi

echo "test_gpu_check: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
