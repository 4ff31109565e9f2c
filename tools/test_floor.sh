#!/usr/bin/env bash
# test_floor.sh: tools/floor.sh's own test. On a copy of the tree, each planted violation adds
# the FAIL line it should: a file that is not on the design card at the top level, a technique
# file past 450 lines, the runtime including a technique, an include cycle, a branch on the
# attention kind or on a dtype in model.cu, train.cu branching on a technique, a guide naming
# too many files. It compares with the copy as it is, so it holds whatever the tree's own
# verdict (an applied experiment may grow a file: that is make floor's business, not this
# test's). Prints "test_floor: N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
passed=0 failed=0
base=$(mktemp -d)
git ls-files | while read -r f; do mkdir -p "$base/$(dirname "$f")"; cp "$f" "$base/$f"; done
cp tools/floor.sh "$base/tools/floor.sh"
(cd "$base" && git init -q && git add -A >/dev/null)
before=$( (cd "$base" && bash tools/floor.sh 2>&1) | grep "FAIL:" | sort)
check() {  # name, text the new FAIL line holds, setup command run in the copy
  local name=$1 want=$2 setup=$3 work
  work=$(mktemp -d)
  cp -a "$base/." "$work/"
  (cd "$work" && eval "$setup" && git add -A >/dev/null)
  local added
  added=$(comm -13 <(echo "$before") <( (cd "$work" && bash tools/floor.sh 2>&1) | grep "FAIL:" | sort))
  if grep -qF -- "$want" <<<"$added"; then passed=$((passed + 1)); else
    failed=$((failed + 1)); echo "FAILED: $name (no new FAIL line with \"$want\"; new: ${added:-none})"; fi
  rm -rf "$work"
}
check "a stray top-level file" "not on the design card" "echo x > helpers.cu"
check "a technique file past 450 lines" "zero.cu has" "for i in \$(seq 460); do echo '//' >> zero.cu; done"
check "the runtime including a technique" "the runtime knows no technique" \
  "sed -i '1i #include \"zero.cuh\"' runtime/report.cu"
check "an include cycle" "include cycle" "sed -i '1i #include \"pipeline_parallel.cuh\"' model.cuh"
check "model.cu branching on the attention kind" "model.cu branches" \
  "echo 'static bool naive(const Model& m) { return m.kind == AttentionKind::Naive; }' >> model.cu"
check "model.cu branching on a dtype" "model.cu branches" \
  "echo '// if (ctx.precision != Precision::FP32)' >> model.cu"
check "train.cu branching on a technique" "train.cu branches" \
  "for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30; do echo \"// if (o.zero > \$i)\" >> train.cu; done"
check "a guide naming five files" "names" \
  "sed -i '0,/^## The code, in order/s//## The code, in order\n\n\`runtime\/ops.cu\` \`runtime\/core.cu\` \`runtime\/comm.cu\` \`runtime\/data.cu\` \`runtime\/launch.cu\`/' docs/zero.md"
rm -rf "$base"
echo "test_floor: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
