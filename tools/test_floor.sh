#!/usr/bin/env bash
# test_floor.sh: tools/floor.sh's own test. On a copy of the tree, the script passes as it is,
# and fails for each planted violation: a file that is not on the design card at the top level,
# a technique file past 400 lines, the runtime including a technique, an include cycle, and a
# branch on the attention kind in model.cu. Prints "test_floor: N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
passed=0 failed=0
check() {  # name, expected exit (0 or 1), setup command run in the copy
  local name=$1 want=$2 setup=$3 work
  work=$(mktemp -d)
  git ls-files | while read -r f; do mkdir -p "$work/$(dirname "$f")"; cp "$f" "$work/$f"; done
  cp tools/floor.sh "$work/tools/floor.sh"
  (cd "$work" && git init -q && git add -A >/dev/null && eval "$setup" && git add -A >/dev/null)
  (cd "$work" && bash tools/floor.sh >"$work/out.txt" 2>&1)
  local got=$?
  if [ "$got" = "$want" ]; then passed=$((passed + 1)); else
    failed=$((failed + 1)); echo "FAILED: $name (exit $got, expected $want)"; tail -5 "$work/out.txt"; fi
  rm -rf "$work"
}
check "the tree as it is" 0 "true"
check "a stray top-level file" 1 "echo x > helpers.cu"
check "a technique file past 400 lines" 1 "for i in \$(seq 400); do echo '//' >> zero.cu; done"
check "the runtime including a technique" 1 "sed -i '1i #include \"zero.cuh\"' runtime/report.cu"
check "an include cycle" 1 "sed -i '1i #include \"pipeline_parallel.cuh\"' model.cuh"
check "model.cu branching on the attention kind" 1 \
  "echo 'static bool naive(const Model& m) { return m.kind == AttentionKind::Naive; }' >> model.cu"
check "model.cu branching on a dtype" 1 "echo '// if (ctx.precision != Precision::FP32)' >> model.cu"
echo "test_floor: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
