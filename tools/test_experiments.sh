#!/usr/bin/env bash
# test_experiments.sh: the "Change one file" table of README.md is true. Every
# docs/experiments/*.patch applies to the tree as it is (git apply --check), and has one row in
# the table, whose second column names exactly the files the patch touches, each with the lines
# `git apply --stat` counts for it (added + deleted): `model.cu` (15), `model.cuh` (2). Every
# patch the table links exists. Prints "test_experiments: N checked, N failed"; exits 1 on a
# failure.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=0 checked=0
fail() { echo "FAILED: $*"; failed=$((failed + 1)); }
pass() { checked=$((checked + 1)); }

# The table's rows: the lines starting with "|" under "## Change one file".
table=$(awk '/^## / { on = ($0 ~ /^## Change one file/) } on && /^\|/' README.md)
[ -n "$table" ] || fail "README.md: no table under \"## Change one file\""

patches=(docs/experiments/*.patch)
[ -e "${patches[0]}" ] || fail "no patch in docs/experiments"
for p in "${patches[@]}"; do
  [ -e "$p" ] || continue
  if git apply --check "$p" 2>/tmp/test_experiments.$$; then pass; else
    fail "$p does not apply to the tree: $(head -2 /tmp/test_experiments.$$ | tr '\n' ' ')"
  fi
  rm -f /tmp/test_experiments.$$
  rows=$(grep -F "($p)" <<<"$table")
  if [ "$(grep -c . <<<"$rows")" -ne 1 ] || [ -z "$rows" ]; then
    fail "$p: expected one row linking it in README's Change one file table"; continue
  fi
  touched=$(git apply --numstat "$p" | awk '{ print $3 " " $1 + $2 }' | sort)
  named=$(awk -F'|' '{ print $3 }' <<<"$rows" | grep -oE '`[^`]+` \([0-9]+\)' |
          sed -E 's/`([^`]+)` \(([0-9]+)\)/\1 \2/' | sort)
  if [ "$touched" = "$named" ]; then pass; else
    fail "$p touches [$(echo $touched)] (file, lines) but the table says [$(echo $named)]"
  fi
done
while IFS= read -r linked; do
  if [ -f "$linked" ]; then pass; else fail "the table links $linked, which does not exist"; fi
done < <(grep -oE '\(docs/experiments/[^)]+\.patch\)' <<<"$table" | tr -d '()')

echo "test_experiments: $checked checked, $failed failed"
[ "$failed" -eq 0 ]
