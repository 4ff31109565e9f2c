#!/usr/bin/env bash
# catch_each.sh RUN BINARY FILTER ARGS...: every Catch2 case of BINARY that FILTER selects, each in
# a process of its own (started through the wrapper RUN, e.g. tools/gpu_check.sh's), so that a
# case that aborts (a [BUG] check, a fault) stops only itself. Prints "=== case NAME" before and
# "=== exit N" after each; tools/gpu_check.sh reads them, tools/test_gpu_check.sh tests them.
# Each case has CASE_TIMEOUT seconds (default 90; then exit 124), so that one stuck case costs
# only its own time and the cases after it still run.
set -u
CASE_TIMEOUT=${CASE_TIMEOUT:-90}
if ! [[ "$CASE_TIMEOUT" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: CASE_TIMEOUT=$CASE_TIMEOUT: expected whole seconds > 0 (unset it for 90)" >&2
  exit 2
fi
run=$1 binary=$2 filter=$3
shift 3
{ "$run" "$binary" "$filter" --list-test-names-only || true; } | grep -v '^$' |
  while IFS= read -r name; do
    echo "=== case $name"
    # Catch2 reads , [ and ] in a filter as its own syntax: escaped, the name is its case alone.
    timeout -k 5 "$CASE_TIMEOUT" "$run" "$binary" "$(printf '%s' "$name" | sed 's/[],[]/\\&/g')" "$@" </dev/null
    echo "=== exit $?"
  done
