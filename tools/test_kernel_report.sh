#!/usr/bin/env bash
# test_kernel_report.sh: one counted case of `make test` (about a minute on two cores). Runs
# tools/kernel_report.sh --check on every kernel in kernels/ (sm_80 and sm_90): no kernel spills,
# the tensor-core kernels still contain ldmatrix, cp.async (FlashAttention-2's) and mma.sync.
# Then plants one violation at a time in a copy of the table it printed (a spill, a kernel whose
# ldmatrix or cp.async is gone, a FlashAttention-2 kernel whose shared memory is unknown or too
# large, a kernel missing for one architecture) and requires --check to name each one. With a
# cuobjdump (tools/sass_tools.sh), the same in the SASS: the kernels keep LDSM, LDGSTS and HMMA,
# and a planted kernel without them is named; without one it prints "SASS: not checked" (a case
# tools/run_tests.sh counts as skipped). Prints "test_kernel_report: N passed, M failed" last.
set -uo pipefail
cd "$(dirname "$0")/.."
T=$(mktemp -d /tmp/test_kernel_report.XXXXXX)
trap 'rm -rf "$T"' EXIT
passed=0 failed=0
check() {  # description, then a command that succeeds when the claim holds
  local what=$1
  shift
  if "$@"; then passed=$((passed + 1)); echo "ok: $what"
  else failed=$((failed + 1)); echo "FAILED: $what"; fi
}

bash tools/kernel_report.sh --check --out "$T/table.md" >"$T/report.log" 2>&1
rc=$?
check "every kernel compiles, none spills, the tensor-core kernels keep their instructions" \
  [ "$rc" -eq 0 ]
[ "$rc" -eq 0 ] || grep -E "VIOLATION|does not compile|error" "$T/report.log" | head -20
tail -1 "$T/report.log"

if [ -s "$T/table.md" ]; then
  # plant NAME_PATTERN ARCH COLUMN VALUE: a copy of the table with that cell changed.
  plant() {
    awk -F'|' -v OFS='|' -v pat="$1" -v arch="$2" -v c="$3" -v val="$4" '
      $2 ~ pat && $3 ~ arch && !done { $c = " " val " "; done = 1 } { print }' "$T/table.md" >"$T/planted.md"
  }
  caught() {  # the message --check must print, for the planted table
    ! bash tools/kernel_report.sh --table "$T/planted.md" >"$T/planted.log" 2>&1 &&
      grep -q "$1" "$T/planted.log"
  }
  plant "flash_forward_bf16_kernel<64, false>" sm_90 5 "8/8"
  check "a kernel that spills is a violation" caught "VIOLATION: flash_forward_bf16_kernel<64, false> (sm_90) spills 8/8"
  plant "flash_backward_bf16_kernel<128, true>" sm_80 9 0
  check "the FlashAttention-2 backward without ldmatrix is a violation" \
    caught "VIOLATION: flash_backward_bf16_kernel<128, true> (sm_80) has no ldmatrix"
  plant "flash_forward_bf16_kernel<128, false>" sm_90 10 0
  check "the FlashAttention-2 forward without cp.async is a violation" \
    caught "VIOLATION: flash_forward_bf16_kernel<128, false> (sm_90) has no cp.async"
  plant "matmul_tensor_cores_kernel" sm_90 11 0
  check "the tensor-core rung without mma is a violation" \
    caught "VIOLATION: matmul_tensor_cores_kernel (sm_90) has no mma"
  plant "flash_backward_bf16_kernel<64, true>" sm_90 7 0
  check "a FlashAttention-2 kernel whose launch's shared memory is unknown is a violation" \
    caught "VIOLATION: flash_backward_bf16_kernel<64, true> (sm_90): its launch's dynamic shared memory is unknown"
  plant "flash_forward_bf16_kernel<64, false>" sm_80 7 170000
  check "a FlashAttention-2 kernel past the architecture's shared memory is a violation" \
    caught "VIOLATION: flash_forward_bf16_kernel<64, false> (sm_80) needs 170000 bytes of shared memory, past 166912"
  grep -v "matmul_tensor_cores_kernel | sm_80" "$T/table.md" >"$T/planted.md"
  check "a tensor-core kernel missing for one architecture is a violation" \
    caught "VIOLATION: no kernel matching matmul_tensor_cores_kernel for sm_80"
  if ! grep -q "SASS not checked" "$T/report.log"; then
    plant "flash_forward_bf16_kernel<128, true>" sm_80 12 0
    check "the FlashAttention-2 forward without LDSM in its SASS is a violation" \
      caught "VIOLATION: flash_forward_bf16_kernel<128, true> (sm_80) has no LDSM in its SASS"
    plant "flash_backward_bf16_kernel<64, false>" sm_90 13 0
    check "the FlashAttention-2 backward without LDGSTS in its SASS is a violation" \
      caught "VIOLATION: flash_backward_bf16_kernel<64, false> (sm_90) has no LDGSTS in its SASS"
    plant "matmul_tensor_cores_kernel" sm_80 14 0
    check "the tensor-core rung without HMMA in its SASS is a violation" \
      caught "VIOLATION: matmul_tensor_cores_kernel (sm_80) has no HMMA in its SASS"
  else
    echo "SASS: not checked (no cuobjdump; tools/sass_tools.sh fetches NVIDIA's)"
  fi
  cp "$T/table.md" "$T/planted.md"
  check "the table as printed passes" bash tools/kernel_report.sh --table "$T/planted.md"
fi
echo "test_kernel_report: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
